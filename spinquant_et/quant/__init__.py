"""Quantizers (fake-quant with STE), RTN with clipping, and the modules that apply them online."""
