"""GPTQ (Frantar et al. 2022) for one linear, with groupwise scales in RTN's layout.

Quantize ``W [out, in]`` column by column, each time spreading the rounding error over the
not-yet-quantized columns through the inverse Hessian ``H = sum x x^T`` of the layer's inputs,
so that ``||X W^T - X Q^T||`` rather than ``||W - Q||`` is minimized. Reference algorithm:
dampening 1% of the mean diagonal, lazy batch updates in blocks of 128 columns.

Groups and act-order. Scales are per group of ``group_size`` consecutive *original* input
channels, exactly RTN's ``[out, in / group_size]`` layout, so the export path is unchanged. A
group's scale is chosen (optionally with RTN's clipping search) when its first column is reached,
from that group's current, error-updated weights. With act-order the columns are visited in
order of decreasing ``diag(H)``; a group's columns are then scattered over the visit order, and
the reference code gets this wrong by taking "the next ``group_size`` visited columns" as a group
and saving scales that match no contiguous group. Here the group is always the original one, its
weights are gathered through the permutation, and integers come back in the original order.
"""

from __future__ import annotations

import torch

from .quantizer import max_abs_scales
from .rtn import clip_scales

DAMP = 0.01
BLOCK = 128


def _group_scale(w: torch.Tensor, bits: int, clip: bool) -> torch.Tensor:
    """``[out]`` scale of one group ``w [out, g]`` (max-abs, or RTN's clipping search)."""
    return (clip_scales if clip else max_abs_scales)(w, bits, w.shape[1])[:, 0]


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, clip: bool = True,
                  act_order: bool = False, damp: float = DAMP, block: int = BLOCK):
    """``(q int8 [out, in], scales fp32 [out, n_groups])`` minimizing the layer's output error.

    ``hessian``: ``[in, in]``, proportional to ``sum x x^T`` over calibration inputs (scale-free).
    ``group_size = -1``: one scale per output row, chosen up front.
    """
    out_f, in_f = weight.shape
    qmax = 2 ** (bits - 1) - 1
    gs = in_f if group_size <= 0 else group_size
    n_groups = in_f // gs
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0  # inputs that never fire: any value works, use 0
    h[dead, dead] = 1
    w[:, dead] = 0

    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(in_f)
    w, h = w[:, perm], h[perm][:, perm]
    position = torch.argsort(perm)  # position[original column] = visit index

    h += damp * torch.mean(torch.diag(h)) * torch.eye(in_f)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    scales = torch.zeros(out_f, n_groups)
    have = torch.zeros(n_groups, dtype=torch.bool)
    q_out = torch.zeros(out_f, in_f)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = int(perm[i1 + i]) // gs
            if not have[g]:
                cols = position[g * gs : (g + 1) * gs]  # this group's visit indices, all >= i1 + i
                current = torch.where((cols >= i1) & (cols < i2), w1[:, (cols - i1).clamp(0, i2 - i1 - 1)], w[:, cols])
                scales[:, g] = _group_scale(current, bits, clip)
                have[g] = True
            col, s = w1[:, i], scales[:, g]
            q = torch.clamp(torch.round(col / s), -qmax - 1, qmax)
            q_out[:, i1 + i] = q
            e = (col - q * s) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q_out[:, position].to(torch.int8), scales


@torch.no_grad()
def float_target(weight: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """The weight GPTQ should aim at so that ``sum ||W x_float - Q x||^2`` is minimized.

    GPTQ on ``W`` with the Hessian of the quantized inputs ``x`` matches this layer's own float output
    on *those* inputs; the error already in ``x`` (from earlier layers and activation quantization)
    is left for later. With ``C = sum x_float x^T`` and ``H = sum x x^T``, ``W C H^-1`` is the
    least-squares map from ``x`` to the float outputs, and the error splits into a constant plus
    ``(W C H^-1 - Q) H (...)^T``: GPTQ on it minimizes the asymmetric objective exactly (GPTAQ, Li et al. 2025).
    """
    # Damped toward W rather than toward 0 (a ridge on W' - W): W' = W (C + lambda I) (H + lambda I)^-1.
    h, c = hessian.double(), cross.double()  # read only: no copies needed
    ridge = damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    return torch.linalg.solve(h + ridge, (weight.double() @ (c + ridge)).T).T.to(weight.dtype)  # H symmetric


class HessianAccumulator:
    """Running ``2/n sum x x^T`` of a linear's inputs ``[..., in]`` (the GPTQ proxy Hessian)."""

    def __init__(self, in_features: int):
        self.h = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        # One window's x^T x in float32 (a few hundred terms: ~1e-6 relative error, and 2-4x faster
        # than float64 on CPU), summed across windows in float64.
        x = x.detach().reshape(-1, x.shape[-1]).float()
        t = x.shape[0]
        self.h *= self.n / (self.n + t)
        self.n += t
        self.h += (x.T @ x).double() * (2 / self.n)
