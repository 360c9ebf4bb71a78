"""What we need to know about each supported architecture, in one table.

Every supported family uses the Llama block (pre-norm attention + gated MLP, RMSNorm, RoPE);
they differ in biases (Qwen2), per-head q/k norms (Qwen3) and attention windows (Mistral), none of
which changes where the rotations go. The rotation plan (which linear reads or writes the
residual stream) is derived from these names, so adding an architecture is adding a row.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpinQuantError


@dataclass(frozen=True)
class ArchSpec:
    """Module names inside an HF ``*ForCausalLM`` of one architecture (paths relative to a layer)."""

    model_type: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3); rotations leave it alone

    @property
    def norm_readers(self) -> dict[str, tuple[str, ...]]:
        """Each per-layer RMSNorm and the linears that read its output (its weight fuses into them)."""
        return {self.attn_norm: (self.q, self.k, self.v), self.mlp_norm: (self.gate, self.up)}

    @property
    def residual_readers(self) -> tuple[str, ...]:
        """Linears whose input is the (normed) residual stream: ``W <- W R1``."""
        return self.q, self.k, self.v, self.gate, self.up

    @property
    def residual_writers(self) -> tuple[str, ...]:
        """Linears whose output is added to the residual stream: ``W <- R1^T W``."""
        return self.o, self.down

    @property
    def linears(self) -> tuple[str, ...]:
        return self.q, self.k, self.v, self.o, self.gate, self.up, self.down


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama"),  # Llama 2/3/3.2, SmolLM/SmolLM2, TinyLlama, ...
    "mistral": ArchSpec("mistral"),
    "qwen2": ArchSpec("qwen2", qkv_bias=True),  # Qwen2 and Qwen2.5
    "qwen3": ArchSpec("qwen3", qk_norm=True),
}


def arch_for(model_type: str | None) -> ArchSpec:
    """The spec of a supported ``config.model_type``; a one-line error naming the list otherwise."""
    try:
        return ARCHITECTURES[model_type or ""]
    except KeyError:
        raise SpinQuantError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
