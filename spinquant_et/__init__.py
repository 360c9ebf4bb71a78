"""spinquant-et: SpinQuant rotations + low-bit quantization for Llama-family models, to ExecuTorch."""

__version__ = "0.1.0"
