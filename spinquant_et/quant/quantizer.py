"""Integer quantizers: symmetric groupwise weights and asymmetric per-token activations.

Conventions (the ones ExecuTorch's ``8da4w`` kernels compute, so fake-quant and ``.pte`` agree):
* weights: symmetric, zero point 0, ``q in [-2^(b-1), 2^(b-1) - 1]``, one fp32 scale per group of
  ``group_size`` consecutive input channels (``group_size = -1``: one per output row);
* activations and KV: asymmetric per token (per row of the last dim, or per group of it),
  ``scale = (max(x, 0) - min(x, 0)) / (2^b - 1)``, integer zero point.
Fake-quant functions use straight-through estimators so they can sit inside a training loop.
"""

from __future__ import annotations

import torch

SCALE_EPS = 1e-8


def groups_of(in_features: int, group_size: int) -> int:
    """Number of groups per row; ``group_size <= 0`` means one group per row (per-channel)."""
    return 1 if group_size <= 0 else in_features // group_size


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out_f, in_f = w.shape
    return w.reshape(out_f, groups_of(in_f, group_size), -1)


def max_abs_scales(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Plain symmetric scales ``[out, n_groups]``: each group's max |w| maps to the largest integer."""
    return (_grouped(w, group_size).abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp_min(SCALE_EPS)


def quantize_weight(w: torch.Tensor, bits: int, group_size: int, scales: torch.Tensor | None = None):
    """Symmetric groupwise quantization of ``w [out, in]``.

    Returns ``(q int8 [out, in], scales fp32 [out, n_groups])``. ``scales`` (e.g. from a clipping
    search) overrides the max-abs scales.
    """
    qmax = 2 ** (bits - 1) - 1
    wg = _grouped(w.float(), group_size)
    if scales is None:
        scales = max_abs_scales(w.float(), bits, group_size)
    q = torch.clamp(torch.round(wg / scales[..., None]), -qmax - 1, qmax)
    return q.reshape(w.shape).to(torch.int8), scales.float()


def dequantize_weight(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q [out, in] * scales [out, n_groups]`` back to float32."""
    out_f, in_f = q.shape
    n_groups = scales.shape[-1]
    return (q.float().reshape(out_f, n_groups, in_f // n_groups) * scales[..., None].float()).reshape(out_f, in_f)


def fake_quant_per_token(x: torch.Tensor, bits: int, group_size: int = 0, clip_ratio: float = 1.0,
                         symmetric: bool = False) -> torch.Tensor:
    """Asymmetric per-token (or per ``group_size`` slice of the last dim) fake quantization, STE.
    ``symmetric``: zero point 0, ``max |x|`` maps to ``2^(b-1) - 1`` (the reference's ``a_asym`` off)."""
    if bits >= 16:
        return x
    shape = x.shape
    xg = x.reshape(*shape[:-1], -1, group_size) if group_size > 0 else x
    if symmetric:
        return _symmetric_fake_quant(x, xg, bits, clip_ratio=clip_ratio)
    maxq = 2**bits - 1
    xmin = xg.amin(-1, keepdim=True).clamp(max=0) * clip_ratio
    xmax = xg.amax(-1, keepdim=True).clamp(min=0) * clip_ratio
    scale = ((xmax - xmin) / maxq).clamp_min(SCALE_EPS)
    zero = torch.round(-xmin / scale)
    q = torch.clamp(torch.round(xg / scale) + zero, 0, maxq)
    deq = ((q - zero) * scale).reshape(shape)
    return x + (deq - x).detach()


def fake_quant_weight_ste(w: torch.Tensor, bits: int, group_size: int, clip_ratio: float = 1.0,
                          scales: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric groupwise weight fake-quant with a straight-through estimator (for training).

    ``scales [out, n_groups]`` (e.g. from the clipping search) override the ``clip_ratio``-scaled max-abs ones.
    """
    if bits >= 16:
        return w
    scale = None if scales is None else scales.clamp_min(SCALE_EPS)[..., None]
    return _symmetric_fake_quant(w, _grouped(w, group_size), bits, scale, clip_ratio)


def _symmetric_fake_quant(x: torch.Tensor, xg: torch.Tensor, bits: int, scale: torch.Tensor | None = None,
                          clip_ratio: float = 1.0) -> torch.Tensor:
    """``x`` fake-quantized with zero point 0 and a straight-through estimator; ``xg`` is its grouped view
    ``[..., groups, size]`` and ``scale`` one per group (default: ``clip_ratio * max |x| / (2^(b-1) - 1)``)."""
    qmax = 2 ** (bits - 1) - 1
    if scale is None:
        scale = (xg.abs().amax(-1, keepdim=True) * clip_ratio / qmax).clamp_min(SCALE_EPS)
    deq = (torch.clamp(torch.round(xg / scale), -qmax - 1, qmax) * scale).reshape(x.shape)
    return x + (deq - x).detach()
