"""--a-clip-search: each linear input's clip ratio chosen by the output error its quantization adds,
recorded in the recipe, and the same model rebuilt from the checkpoint."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from spinquant_et.errors import SpinQuantError
from spinquant_et.quant.act_clip import ACT_CLIP_GRID, best_clip
from spinquant_et.quant.quantizer import fake_quant_per_token
from spinquant_et.quantize import quantize
from spinquant_et.recipe import QuantRecipe


def _linear(in_f, out_f, seed):
    from spinquant_et.online import QuantLinear

    lin = torch.nn.Linear(in_f, out_f, bias=False)
    torch.nn.init.normal_(lin.weight, generator=torch.Generator().manual_seed(seed))
    return QuantLinear(lin, a_bits=4)


def _output_errors(xs, lin):
    """The output error per grid ratio, computed directly (not through best_clip's Gram matrix)."""
    return [sum(((fake_quant_per_token(x, 4, 0, c) - x) @ lin.weight.T).square().sum().item() for x in xs)
            for c in ACT_CLIP_GRID]


def test_best_clip_is_the_ratio_of_least_output_error():
    """Gaussian tokens of 1536 values (as after R4): the range of the largest value wastes 4-bit levels,
    so a ratio below 1 wins; 8 uniform values per token fill their range, so nothing should be clipped."""
    g = torch.Generator().manual_seed(0)
    lin = _linear(1536, 64, 1)
    gauss = [torch.randn(256, 1536, generator=g) for _ in range(2)]
    errors = _output_errors(gauss, lin)
    assert best_clip(gauss, [lin]) == ACT_CLIP_GRID[errors.index(min(errors))] < 1.0

    small = _linear(8, 16, 2)
    uniform = [torch.rand(256, 8, generator=g) * 2 - 1 for _ in range(2)]
    assert best_clip(uniform, [small]) == 1.0


def test_search_records_a_ratio_per_linear_and_the_checkpoint_rebuilds_the_model(tiny_tokenizer, tmp_path):
    from spinquant_et.checkpoint import load_quantized, save_quantized
    from spinquant_et.data import builtin_text, calibration_samples, tokenize

    calib = calibration_samples(tokenize(tiny_tokenizer, builtin_text("train")), 64, 16, seed=0)
    loaded = tiny_model("llama")
    loaded.tokenizer = tiny_tokenizer  # the checkpoint carries one
    recipe = QuantRecipe(a_bits=4, kv_bits=4, o_per_head=True, a_clip_search=True)
    qm = quantize(loaded, recipe, progress=False, calibration=calib)
    layers = loaded.model.model.layers
    names = {f"model.layers.{i}.{n}" for i in range(len(layers)) for n in loaded.arch.linears}
    assert set(recipe.a_clips) == names and set(recipe.a_clips.values()) <= set(ACT_CLIP_GRID)
    assert all(loaded.model.get_submodule(n).a_clip == c for n, c in recipe.a_clips.items())
    q, k, v = (recipe.a_clips[f"model.layers.0.{n}"] for n in (loaded.arch.q, loaded.arch.k, loaded.arch.v))
    assert q == k == v  # one input, one quantizer

    ids = calib[:2]
    with torch.no_grad():
        before = loaded.model(ids).logits
    reloaded = load_quantized(save_quantized(qm, tmp_path / "q"))
    assert reloaded.recipe.a_clips == recipe.a_clips
    with torch.no_grad():
        torch.testing.assert_close(reloaded.model(ids).logits, before)


def test_search_needs_gptq_and_is_not_exportable():
    from spinquant_et.export.build import check_exportable

    with pytest.raises(SpinQuantError, match="--a-clip-search"):
        QuantRecipe(a_bits=4, w_method="rtn", a_clip_search=True)
    with pytest.raises(SpinQuantError, match="not exportable"):
        check_exportable(QuantRecipe(a_clip_search=True))
