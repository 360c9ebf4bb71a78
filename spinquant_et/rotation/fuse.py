"""Fold every RMSNorm weight into the linears that read its output.

``RMSNorm(x) * g`` feeding ``W`` equals ``RMSNorm(x)`` feeding ``W diag(g)``. After fusion every
norm is a pure ``x / rms(x)``, which commutes with any orthogonal R1 (it preserves the norm), so
R1 can then be pushed through the residual stream.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.arch import ArchSpec


def _scale_inputs(linear: nn.Linear, g: torch.Tensor) -> None:
    linear.weight.data = (linear.weight.double() * g.double()[None, :]).to(linear.weight.dtype)


@torch.no_grad()
def fuse_layer_norms(layer: nn.Module, arch: ArchSpec) -> None:
    """Fold one decoder layer's RMSNorm weights into the linears that read them; norms become 1."""
    for norm_name, readers in arch.norm_readers.items():
        norm = layer.get_submodule(norm_name)
        for reader in readers:
            _scale_inputs(layer.get_submodule(reader), norm.weight)
        norm.weight.fill_(1.0)


@torch.no_grad()
def fuse_norms(model: nn.Module, arch: ArchSpec) -> None:
    """Fold per-layer and final RMSNorm weights into their readers and set the norms to 1 (in place)."""
    for layer in model.get_submodule(arch.layers):
        fuse_layer_norms(layer, arch)
    norm = model.get_submodule(arch.final_norm)
    _scale_inputs(model.get_submodule(arch.lm_head), norm.weight)
    norm.weight.fill_(1.0)
