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


def rotated_layer_tensors(layer: nn.Module, arch: ArchSpec, r1: torch.Tensor, r2: torch.Tensor,
                          head_dim: int) -> dict[str, torch.Tensor]:
    """``{"<linear>.weight" | "<linear>.bias": rotated tensor}`` of one decoder layer (R1 and R2 rows
    of the module table), computed in ``r1``'s dtype and differentiable in ``r1``/``r2``."""
    dt = r1.dtype
    out: dict[str, torch.Tensor] = {}

    def get(name: str, attr: str = "weight") -> torch.Tensor | None:
        key = f"{name}.{attr}"
        if key in out:
            return out[key]
        t = getattr(layer.get_submodule(name), attr)
        return None if t is None else t.to(dt)

    for name in arch.residual_readers:
        out[f"{name}.weight"] = get(name) @ r1
    for name in arch.residual_writers:
        out[f"{name}.weight"] = r1.T @ get(name)
        if get(name, "bias") is not None:
            out[f"{name}.bias"] = get(name, "bias") @ r1
    w = get(arch.v)
    out[f"{arch.v}.weight"] = (r2.T @ w.reshape(-1, head_dim, w.shape[1])).reshape(w.shape)
    if get(arch.v, "bias") is not None:
        out[f"{arch.v}.bias"] = (get(arch.v, "bias").reshape(-1, head_dim) @ r2).reshape(-1)
    w = get(arch.o)
    out[f"{arch.o}.weight"] = (w.reshape(w.shape[0], -1, head_dim) @ r2).reshape(w.shape)
    return out


def _assign(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for key, value in tensors.items():
        name, _, attr = key.rpartition(".")
        _set(module.get_submodule(name), attr, value)


@torch.no_grad()
def apply_r4_layer(layer: nn.Module, arch: ArchSpec, h4: HadamardTransform) -> None:
    """The offline half of R4 on one layer: ``down_proj.weight <- W H4^T`` (``h4`` in float64)."""
    down = layer.get_submodule(arch.down)
    _set(down, "weight", h4(down.weight.double()))


@torch.no_grad()
def apply_r4_weights(model: nn.Module, arch: ArchSpec) -> None:
    """The offline half of R4: ``down_proj.weight <- W H4^T`` (its input gets ``x H4^T`` online)."""
    h4 = HadamardTransform(model.config.intermediate_size).double()
    for layer in model.get_submodule(arch.layers):
        apply_r4_layer(layer, arch, h4)


@torch.no_grad()
def rotate_layer(layer: nn.Module, arch: ArchSpec, r1: torch.Tensor, r2: torch.Tensor, head_dim: int) -> None:
    """R1 and R2 into one norm-fused decoder layer's weights, in place (float64 arithmetic)."""
    _assign(layer, rotated_layer_tensors(layer, arch, r1.double(), r2.double(), head_dim))


@torch.no_grad()
def rotate_rows(w: torch.Tensor, r1: torch.Tensor) -> torch.Tensor:
    """``W R1`` for an embedding table or lm_head ``[rows, hidden]``, in float64, back in ``w``'s dtype."""
    return (w.double() @ r1.double()).to(w.dtype)


@torch.no_grad()
def rotate_model(model: nn.Module, arch: ArchSpec, r1: torch.Tensor, r2: list[torch.Tensor], r4: bool = True) -> None:
    """Rotate the weights of a norm-fused, untied model in place (see the module table)."""
    hd = head_dim_of(model.config)
    for name in (arch.embed, arch.lm_head):
        _set(model.get_submodule(name), "weight", rotate_rows(model.get_submodule(name).weight, r1))
    for layer, r2_l in zip(model.get_submodule(arch.layers), r2, strict=True):
        rotate_layer(layer, arch, r1, r2_l, hd)
    if r4:
        apply_r4_weights(model, arch)
