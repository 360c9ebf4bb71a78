"""What runs at inference time on top of the rotated weights.

* ``QuantLinear``: an ``nn.Linear`` (same state-dict keys) with an optional online Hadamard on its
  input (R4 on down_proj) and per-token activation fake-quant.
* ``spinquant_sdpa``: an attention function registered with transformers' ``AttentionInterface``.
  It receives Q and K after RoPE, applies R3 to both, fake-quantizes K and V per token and per
  head (the KV cache layout), then runs transformers' own SDPA attention.
* ``attach_online(model, arch, recipe)``: puts both in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .hadamard import HadamardTransform
from .models.arch import ArchSpec
from .quant.quantizer import fake_quant_per_token
from .recipe import NO_QUANT, QuantRecipe

ATTN_IMPL = "spinquant_sdpa"


class QuantLinear(nn.Linear):
    """``y = Q_a(T(x)) W^T + b``: T an optional online Hadamard, Q_a per-token fake-quant."""

    def __init__(self, linear: nn.Linear, a_bits: int = NO_QUANT, input_transform: nn.Module | None = None,
                 a_group_size: int = 0, a_clip: float = 1.0, a_sym: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.a_bits, self.a_group_size, self.a_clip, self.a_sym = a_bits, a_group_size, a_clip, a_sym
        self.input_transform = input_transform

    def transformed_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input after the online Hadamard, before quantization."""
        return x if self.input_transform is None else self.input_transform(x)

    def effective_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the weight multiplies: the transformed, quantized input (GPTQ's Hessian is built from it)."""
        return fake_quant_per_token(self.transformed_input(x), self.a_bits, self.a_group_size, self.a_clip, self.a_sym)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.effective_input(x), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, a_bits={self.a_bits}, a_group_size={self.a_group_size}, a_clip={self.a_clip}"


class KVQuantizer(nn.Module):
    """Per-token, per-head fake-quant of K or V ``[batch, heads, seq, head_dim]``: asymmetric (the exported
    int8 cache's), or with ``symmetric`` zero point 0."""

    def __init__(self, bits: int, clip: float = 1.0, symmetric: bool = False):
        super().__init__()
        self.bits, self.clip, self.symmetric = bits, clip, symmetric

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_per_token(x, self.bits, clip_ratio=self.clip, symmetric=self.symmetric)


def spinquant_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA with R3 on Q/K after RoPE and K/V fake-quant, driven by attributes of the attention module."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    r3 = getattr(module, "r3", None)
    if r3 is not None:
        query, key = r3(query), r3(key)
    k_quant, v_quant = getattr(module, "k_quant", None), getattr(module, "v_quant", None)
    if k_quant is not None:
        key, value = k_quant(key), v_quant(value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, spinquant_sdpa)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


def _replace(parent: nn.Module, path: str, new: nn.Module) -> None:
    owner, _, name = path.rpartition(".")
    setattr(parent.get_submodule(owner) if owner else parent, name, new)


def attach_online(model: nn.Module, arch: ArchSpec, rotated: bool, a_bits: int, kv_bits: int, a_clip: float = 1.0,
                  k_clip: float = 1.0, v_clip: float = 1.0, o_per_head: bool = False,
                  a_clips: dict[str, float] | None = None, a_sym: bool = False) -> nn.Module:
    """Install R3/R4 (when ``rotated``) and activation/KV fake-quant; idempotent, returns ``model``.

    Every linear but lm_head gets its input quantized (lm_head's input stays float, as in SpinQuant).
    ``a_clip``/``k_clip``/``v_clip`` shrink each token's range before quantizing (QuaRot/SpinQuant's
    ``a_clip_ratio``, ``k_clip_ratio``, ``v_clip_ratio``); ``o_per_head`` quantizes o_proj's input per
    head (``head_dim`` groups, as the SpinQuant reference does) instead of per token over all heads.
    ``a_clips`` (``{linear name: ratio}``, from ``--a-clip-search``) overrides ``a_clip`` per linear;
    ``a_sym`` makes activations and K/V symmetric (zero point 0).
    """
    from .rotation.apply import head_dim_of

    _register_attention()
    cfg = model.config
    hd = head_dim_of(cfg)
    a_clips = a_clips or {}
    for i, layer in enumerate(model.get_submodule(arch.layers)):
        for name in arch.linears:
            lin = layer.get_submodule(name)
            transform = HadamardTransform(cfg.intermediate_size) if (rotated and name == arch.down) else None
            group = hd if (o_per_head and name == arch.o) else 0
            clip = a_clips.get(f"{arch.layers}.{i}.{name}", a_clip)
            if isinstance(lin, QuantLinear):
                lin.a_bits, lin.input_transform, lin.a_group_size, lin.a_clip = a_bits, transform, group, clip
                lin.a_sym = a_sym
            else:
                _replace(layer, name, QuantLinear(lin, a_bits, transform, group, clip, a_sym))
        attn = layer.get_submodule(arch.q.rpartition(".")[0])
        attn.r3 = HadamardTransform(hd) if rotated else None
        quantized = kv_bits < NO_QUANT
        attn.k_quant = KVQuantizer(kv_bits, k_clip, a_sym) if quantized else None
        attn.v_quant = KVQuantizer(kv_bits, v_clip, a_sym) if quantized else None
    model.set_attn_implementation(ATTN_IMPL)
    return model


def attach_recipe(model: nn.Module, arch: ArchSpec, recipe: QuantRecipe) -> nn.Module:
    return attach_online(model, arch, recipe.rotated, recipe.a_bits, recipe.kv_bits, **recipe.online_kwargs())
