"""Per-linear activation clip ratios, chosen on calibration text (``--a-clip-search``; eager only).

One clip ratio for every linear input (QuaRot/SpinQuant's ``a_clip_ratio``) is a compromise: the
best range of a per-token 4-bit quantizer depends on how many values share a scale and on their
tails (576 after R1, 1536 after R4's Hadamard, 64 per head for o_proj with ``--o-per-head``). Here
each input gets the ratio from ``ACT_CLIP_GRID`` that minimises the output error its quantization
adds, ``sum ||(Q_c(x) - x) W^T||^2`` over every linear reading that input, on calibration tokens
that carry the quantization of everything before them (GPTQ's layer-by-layer inputs).
"""

from __future__ import annotations

import torch

from .quantizer import fake_quant_per_token

ACT_CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
CLIP_WINDOWS = 16  # calibration windows the choice is made on (of GPTQ's; the Hessians use them all)


@torch.no_grad()
def best_clip(inputs, linears: list[torch.nn.Module], grid: tuple[float, ...] = ACT_CLIP_GRID) -> float:
    """The ratio of ``grid`` with the least output error over ``inputs`` (``[tokens, in]`` tensors, before
    quantization) for ``linears``, which share that input and its quantizer (the first one's bits and group)."""
    first = linears[0]
    gram = sum(m.weight.double().T @ m.weight.double() for m in linears).float()  # ||e W^T||^2 = e G e^T
    errors = torch.zeros(len(grid), dtype=torch.float64)
    for x in inputs:
        for j, c in enumerate(grid):
            e = fake_quant_per_token(x, first.a_bits, first.a_group_size, c, first.a_sym) - x
            errors[j] += ((e @ gram) * e).sum().double()
    return grid[int(errors.argmin())]
