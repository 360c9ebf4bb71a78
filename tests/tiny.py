"""Tiny random models of every supported architecture (real HF modules, random weights)."""

from __future__ import annotations

import torch

from spinquant_et.models.arch import arch_for
from spinquant_et.models.load import LoadedModel, untie_embeddings

# hidden 96 = 12*8, intermediate 160 = 20*8, head_dim 16: non-power-of-two Hadamards on purpose.
TINY_VOCAB = 384
COMMON = dict(
    vocab_size=TINY_VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
)


def tiny_config(model_type: str, tie: bool = False, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    return cls(**{**COMMON, **overrides}, tie_word_embeddings=tie)


def perturb_norms_and_biases(model: torch.nn.Module) -> None:
    """Norms away from 1 and biases away from 0 (transformers initialises them to exactly that), so
    that fusing them into the linears is really tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.rand_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))


def tiny_model(model_type: str = "llama", tie: bool = False, seed: int = 0, **overrides) -> LoadedModel:
    """A random model whose norms and biases are non-trivial, so fusion and rotation are really tested."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, tie, **overrides), dtype=torch.float32)
    perturb_norms_and_biases(model)
    if tie:
        model.tie_weights()
    model.eval().requires_grad_(False)
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        return LoadedModel(model=model, tokenizer=None, arch=arch_for(model_type), source=f"tiny-{model_type}-tied")
    untie_embeddings(model)
    return LoadedModel(model=model, tokenizer=None, arch=arch_for(model_type), source=f"tiny-{model_type}")
