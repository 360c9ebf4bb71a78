import pytest
import torch

from spinquant_et.errors import SpinQuantError
from spinquant_et.quant.quantizer import dequantize_weight, fake_quant_per_token, quantize_weight
from spinquant_et.quant.rtn import CLIP_NORM, rtn_quantize
from spinquant_et.recipe import QuantRecipe


@pytest.mark.parametrize("bits,group", [(4, 32), (4, -1), (8, 64), (2, 128), (3, 256)])
def test_weight_quantization_range_and_error(bits, group):
    w = torch.randn(16, 256)
    q, s = quantize_weight(w, bits, group)
    assert q.dtype == torch.int8 and s.shape == (16, 1 if group == -1 else 256 // group)
    assert q.min() >= -(2 ** (bits - 1)) and q.max() <= 2 ** (bits - 1) - 1
    err = (dequantize_weight(q, s) - w).abs()
    step = s.repeat_interleave(256 // s.shape[1], dim=1)
    assert (err <= step / 2 + 1e-6).all()  # round to nearest, no clipping with max-abs scales


def test_clip_search_never_worse_than_max_abs_per_group():
    w = torch.randn(32, 512) * torch.rand(32, 1) + torch.randn(32, 512).pow(3) * 0.1  # heavy tails
    q0, s0 = quantize_weight(w, 4, 32)
    q1, s1 = rtn_quantize(w, 4, 32, clip=True)

    def group_err(q, s):
        return (dequantize_weight(q, s) - w).abs().pow(CLIP_NORM).view(32, -1, 32).sum(-1)

    assert (group_err(q1, s1) <= group_err(q0, s0) + 1e-6).all()
    assert group_err(q1, s1).sum() < 0.95 * group_err(q0, s0).sum()  # and clearly better overall
    assert (s1 <= s0 + 1e-12).all()


def test_per_token_activation_quant_is_asymmetric_and_bounded():
    x = torch.randn(4, 7, 96) + 3.0  # all-positive-ish rows: asymmetric range matters
    for bits in (8, 4):
        y = fake_quant_per_token(x, bits)
        rng = x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)
        assert ((y - x).abs() <= rng / (2**bits - 1) / 2 + 1e-5).all()
        assert len(torch.unique(y[0, 0])) <= 2**bits
    assert fake_quant_per_token(x, 16) is x


def test_fake_quant_has_straight_through_gradient():
    x = torch.randn(3, 64, requires_grad=True)
    fake_quant_per_token(x, 4).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_kv_groups_are_per_head():
    x = torch.randn(2, 3, 5, 16)
    x[:, 0] *= 100  # a loud head must not wreck the quiet ones
    y = fake_quant_per_token(x, 4)
    assert (y[:, 1:] - x[:, 1:]).abs().max() < 0.5


@pytest.mark.parametrize("bad", [dict(w_bits=1), dict(a_bits=9), dict(group_size=0), dict(w_method="awq"),
                                 dict(rotation="spin")])
def test_recipe_rejects_bad_values(bad):
    with pytest.raises(SpinQuantError):
        QuantRecipe(**bad)


def test_group_size_that_does_not_divide_names_the_layer():
    with pytest.raises(SpinQuantError, match=r"--group-size 64 does not divide in_features 96 of .*q_proj; use e.g. 32"):
        QuantRecipe(group_size=64).check_dims({"model.layers.0.self_attn.q_proj": 96, "x.down_proj": 160})


def test_recipe_json_round_trip():
    r = QuantRecipe(rotation="none", w_bits=3, group_size=128, a_bits=4, kv_bits=8, w_clip=False)
    assert QuantRecipe.from_json(r.to_json()) == r


def test_weight_fake_quant_with_given_scales_matches_rtn_and_passes_gradients():
    """What `optimize` trains through when --w-bits < 16: the clipping search's RTN, straight-through."""
    from spinquant_et.quant.quantizer import dequantize_weight, fake_quant_weight_ste, quantize_weight
    from spinquant_et.quant.rtn import clip_scales

    w = torch.randn(16, 64, requires_grad=True)
    scales = clip_scales(w.detach(), 4, 32)
    out = fake_quant_weight_ste(w, 4, 32, scales=scales)
    torch.testing.assert_close(out, dequantize_weight(*quantize_weight(w.detach(), 4, 32, scales)))
    out.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_clipping_search_in_blocks_is_the_whole_matrix_search(monkeypatch):
    """The search runs a block of rows at a time (speed); every group keeps the scale a search over the
    whole matrix picks, bit for bit, and a picked ratio below 1 shows the search did something."""
    from spinquant_et.quant import rtn

    w = torch.randn(70, 96) * torch.rand(70, 1)  # 70 rows: blocks of 8 leave a last block of 6
    monkeypatch.setattr(rtn, "CLIP_BLOCK", 8 * 96)
    blocked = rtn.clip_scales(w, 4, 32)
    monkeypatch.setattr(rtn, "CLIP_BLOCK", 1 << 30)
    whole = rtn.clip_scales(w, 4, 32)
    assert torch.equal(blocked, whole)
    amax = w.view(70, 3, 32).abs().amax(-1)
    assert (blocked * 7 < amax * 0.999).any()


@pytest.mark.parametrize("bad", [dict(a_clip=0.3), dict(k_clip=1.1), dict(v_clip=0)])
def test_clip_ratios_out_of_range_are_refused(bad):
    with pytest.raises(SpinQuantError, match="clip must be in"):
        QuantRecipe(**bad)


def test_online_clip_ratios_and_per_head_o_proj_reach_the_quantizers(tiny_hf_dir):
    """The recipe's eager-only A4/KV4 levers land on every quantizer they name, and o_proj's per-head
    grouping keeps one loud head from wrecking the others' resolution."""
    from spinquant_et.models import load_model
    from spinquant_et.online import QuantLinear, attach_recipe

    loaded = load_model(str(tiny_hf_dir["llama"]))
    recipe = QuantRecipe(a_bits=4, kv_bits=4, a_clip=0.9, k_clip=0.95, v_clip=0.8, o_per_head=True)
    attach_recipe(loaded.model, loaded.arch, recipe)
    layer = loaded.model.model.layers[0]
    o = layer.self_attn.o_proj
    assert isinstance(o, QuantLinear) and o.a_group_size == loaded.model.config.head_dim and o.a_clip == 0.9
    assert layer.mlp.down_proj.a_group_size == 0
    assert (layer.self_attn.k_quant.clip, layer.self_attn.v_quant.clip) == (0.95, 0.8)
    x = torch.randn(1, 4, o.in_features)
    x[..., : o.a_group_size] *= 100
    quiet = slice(o.a_group_size, None)
    per_head = (o.effective_input(x) - x)[..., quiet].abs().max()
    o.a_group_size = 0
    assert per_head < 0.2 * (o.effective_input(x) - x)[..., quiet].abs().max()


def test_eager_only_levers_are_not_exportable():
    from spinquant_et.export.build import check_exportable

    for kw in (dict(a_clip=0.9), dict(o_per_head=True), dict(kv_bits=8, k_clip=0.9), dict(a_sym=True)):
        with pytest.raises(SpinQuantError, match="not exportable"):
            check_exportable(QuantRecipe(**kw))


def test_symmetric_activations_keep_zero_and_the_sign_balanced_grid(tiny_hf_dir):
    """--a-sym: zero point 0 (a zero stays exactly zero, the grid is -8..7 steps of max|x|/7) on linear
    inputs and K/V alike; the default asymmetric grid spends its 16 levels on [min, max] instead."""
    from spinquant_et.models import load_model
    from spinquant_et.online import attach_recipe

    x = torch.tensor([[0.0, 0.3, 0.7, -0.05, 0.01] + [0.02] * 3])
    sym = fake_quant_per_token(x, 4, symmetric=True)
    scale = 0.7 / 7
    torch.testing.assert_close(sym, torch.round(x / scale) * scale)
    asym = fake_quant_per_token(x, 4)
    assert (sym - x).abs().max() > (asym - x).abs().max()  # one-sided data: asymmetric wastes fewer levels

    loaded = load_model(str(tiny_hf_dir["llama"]))
    attach_recipe(loaded.model, loaded.arch, QuantRecipe(a_bits=4, kv_bits=4, a_sym=True))
    attn = loaded.model.model.layers[0].self_attn
    assert attn.o_proj.a_sym and attn.k_quant.symmetric and attn.v_quant.symmetric
