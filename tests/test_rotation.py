"""Rotations must not change what the float model computes (every architecture, tied or not)."""

import pytest
import torch
from tiny import tiny_model

from spinquant_et.online import QuantLinear
from spinquant_et.quantize import quantize
from spinquant_et.recipe import QuantRecipe

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
FLOAT = dict(w_bits=16, a_bits=16, kv_bits=16, embedding_bits=16, lm_head_bits=16)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", ARCHS)
def test_hadamard_rotation_preserves_logits(model_type, tie):
    loaded = tiny_model(model_type, tie=tie)
    x = torch.randint(0, loaded.model.config.vocab_size, (2, 48))
    ref = loaded.model(x).logits
    q_before = loaded.model.model.layers[0].self_attn.q_proj.weight.clone()
    quantize(loaded, QuantRecipe(rotation="hadamard", **FLOAT), progress=False)
    m = loaded.model
    # The rotation really happened: weights moved, lm_head untied, R3/R4 installed.
    assert rel_err(m.model.layers[0].self_attn.q_proj.weight, q_before) > 0.5
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
    assert m.model.layers[0].self_attn.r3 is not None
    assert isinstance(m.model.layers[0].mlp.down_proj, QuantLinear)
    assert m.model.layers[0].mlp.down_proj.input_transform is not None
    assert rel_err(m(x).logits, ref) < 1e-4


def test_norms_are_fused_to_one():
    loaded = tiny_model("llama")
    quantize(loaded, QuantRecipe(rotation="none", **FLOAT), progress=False)
    for name, p in loaded.model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            assert torch.equal(p, torch.ones_like(p)), name


def test_online_r4_is_load_bearing():
    """down_proj's weight was multiplied by H4^T: without the online H4 on its input the model breaks."""
    loaded = tiny_model("llama")
    x = torch.randint(0, 384, (1, 32))
    ref = loaded.model(x).logits
    quantize(loaded, QuantRecipe(rotation="hadamard", **FLOAT), progress=False)
    for layer in loaded.model.model.layers:
        layer.mlp.down_proj.input_transform = None
    assert rel_err(loaded.model(x).logits, ref) > 1e-2


def test_rotation_reduces_activation_outliers():
    """The point of R1: the residual stream entering q/k/v is flatter (lower max/rms ratio)."""
    loaded = tiny_model("llama")
    with torch.no_grad():  # plant an outlier channel, as trained LLMs have
        loaded.model.model.embed_tokens.weight[:, 7] *= 30
    x = torch.randint(0, 384, (1, 64))
    captured = {}
    hook = lambda m, args: captured.__setitem__("x", args[0])  # noqa: E731
    h = loaded.model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(hook)
    loaded.model(x)
    before = (captured["x"].abs().amax(-1) / captured["x"].pow(2).mean(-1).sqrt()).mean()
    h.remove()
    quantize(loaded, QuantRecipe(rotation="hadamard", **FLOAT), progress=False)
    loaded.model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(hook)
    loaded.model(x)
    after = (captured["x"].abs().amax(-1) / captured["x"].pow(2).mean(-1).sqrt()).mean()
    assert after < before / 2
