"""Apply R1 (residual stream), R2 (per head, v/o) and the weight side of R4 (down_proj input).

Row-vector convention (``y = x W^T``, ``W [out, in]``), with the residual stream ``h -> h R1``:

| where                     | change                           | why                                  |
|---------------------------|----------------------------------|--------------------------------------|
| embeddings ``E [V, d]``   | ``E R1``                         | the stream starts rotated            |
| q, k, v, gate, up, lm_head| ``W R1``                         | they read the rotated stream         |
| o_proj, down_proj         | ``R1^T W`` (bias ``b R1``)       | they write into the rotated stream   |
| v_proj rows of head h     | ``R2^T W_h`` (bias ``b_h R2``)   | each value head leaves rotated by R2 |
| o_proj columns of head h  | ``W_h R2``                       | ...and o_proj undoes it              |
| down_proj                 | ``W H4^T``                       | its input gets ``x H4^T`` online (R4)|

Norm weights must be fused first (``fuse.fuse_norms``). R3 needs no weight change: Q and K are
both rotated online after RoPE, which leaves ``Q K^T`` unchanged. Work is done in float64.
"""

from __future__ import annotations

import torch
from torch import nn

from ..hadamard import HadamardTransform, random_hadamard_matrix
from ..models.arch import ArchSpec


def _set(linear: nn.Module, attr: str, value: torch.Tensor) -> None:
    p = getattr(linear, attr)
    p.data = value.to(p.dtype)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def random_rotations(config, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Random-Hadamard R1 ``[hidden, hidden]`` and one R2 ``[head_dim, head_dim]`` per layer (float64)."""
    g = torch.Generator().manual_seed(seed)
    r1 = random_hadamard_matrix(config.hidden_size, g)
    hd = head_dim_of(config)
    return r1, [random_hadamard_matrix(hd, g) for _ in range(config.num_hidden_layers)]


@torch.no_grad()
def rotate_model(model: nn.Module, arch: ArchSpec, r1: torch.Tensor, r2: list[torch.Tensor], r4: bool = True) -> None:
    """Rotate the weights of a norm-fused, untied model in place (see the module table)."""
    cfg = model.config
    hd = head_dim_of(cfg)
    r1 = r1.double()
    embed = model.get_submodule(arch.embed)
    _set(embed, "weight", embed.weight.double() @ r1)
    head = model.get_submodule(arch.lm_head)
    _set(head, "weight", head.weight.double() @ r1)
    h4 = HadamardTransform(cfg.intermediate_size).double() if r4 else None
    for layer, r2_l in zip(model.get_submodule(arch.layers), r2, strict=True):
        r2_l = r2_l.double()
        for name in arch.residual_readers:
            lin = layer.get_submodule(name)
            _set(lin, "weight", lin.weight.double() @ r1)
        for name in arch.residual_writers:
            lin = layer.get_submodule(name)
            _set(lin, "weight", r1.T @ lin.weight.double())
            if lin.bias is not None:
                _set(lin, "bias", lin.bias.double() @ r1)
        v = layer.get_submodule(arch.v)
        w = v.weight.double().view(-1, hd, v.in_features)  # [kv_heads, hd, hidden]
        _set(v, "weight", (r2_l.T @ w).reshape(v.weight.shape))
        if v.bias is not None:
            _set(v, "bias", (v.bias.double().view(-1, hd) @ r2_l).reshape(-1))
        o = layer.get_submodule(arch.o)
        w = o.weight.double().view(o.out_features, -1, hd)  # [hidden, heads, hd]
        _set(o, "weight", (w @ r2_l).reshape(o.weight.shape))
        if h4 is not None:
            down = layer.get_submodule(arch.down)
            _set(down, "weight", h4(down.weight.double()))
