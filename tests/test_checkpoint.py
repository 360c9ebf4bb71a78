"""quantize -> checkpoint directory -> load: the same model, integers in range, atomic writes."""

import json

import pytest
import torch
from safetensors.torch import load_file

from spinquant_et.checkpoint import load_quantized, save_quantized
from spinquant_et.errors import SpinQuantError
from spinquant_et.io import atomic_output_dir
from spinquant_et.models import load_model
from spinquant_et.quantize import quantize
from spinquant_et.recipe import QuantRecipe


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_saved_checkpoint_reloads_to_identical_logits(tiny_hf_dir, tmp_path, model_type):
    loaded = load_model(tiny_hf_dir[model_type])
    recipe = QuantRecipe(rotation="hadamard", w_bits=4, group_size=32, a_bits=8, kv_bits=4)
    qm = quantize(loaded, recipe, progress=False)
    x = torch.randint(0, 384, (2, 40))
    expected = qm.loaded.model(x).logits
    out = save_quantized(qm, tmp_path / "ckpt")
    tensors = load_file(str(out / "model.safetensors"))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.int8 and -8 <= q.min() and q.max() <= 7
    assert tensors["model.layers.0.self_attn.q_proj.scales"].shape == (q.shape[0], q.shape[1] // 32)
    assert tensors["model.embed_tokens.weight"].dtype == torch.int8
    assert tensors["lm_head.scales"].shape == (384, 1)
    assert json.loads((out / "recipe.json").read_text())["kv_bits"] == 4
    reloaded = load_quantized(out)
    assert reloaded.recipe == recipe
    assert torch.allclose(reloaded.model(x).logits, expected, atol=1e-5, rtol=1e-5)


def test_existing_output_is_refused_then_replaced_with_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("x")
    with pytest.raises(SpinQuantError, match="already exists; pass --force"):
        with atomic_output_dir(out):
            pass
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new").write_text("y")
    assert sorted(p.name for p in out.iterdir()) == ["new"]


def test_interrupted_write_leaves_nothing_behind(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out) as tmp:
            (tmp / "half").write_text("partial")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_missing_tensors_is_a_clear_error(tiny_hf_dir, tmp_path):
    from safetensors.torch import save_file

    qm = quantize(load_model(tiny_hf_dir["llama"]), QuantRecipe(), progress=False)
    out = save_quantized(qm, tmp_path / "ckpt")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(SpinQuantError, match=r"missing tensors: model.layers.1.mlp.up_proj.weight; re-run quantize"):
        load_quantized(out)
