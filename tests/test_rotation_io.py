"""R.bin in the reference SpinQuant format: round trip, checks, and use as --rotation."""

import pytest
import torch
from tiny import tiny_model

from spinquant_et.errors import SpinQuantError
from spinquant_et.quantize import quantize
from spinquant_et.recipe import QuantRecipe
from spinquant_et.rotation import random_rotations
from spinquant_et.rotation.io import load_rotations, r2_key, save_rotations


def test_round_trip_and_reference_key_names(tmp_path):
    cfg = tiny_model("llama").model.config
    r1, r2 = random_rotations(cfg, seed=3)
    path = tmp_path / "R.bin"
    save_rotations(path, r1, r2)
    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"R1", r2_key(0), r2_key(1)} and raw["R1"].dtype == torch.float32
    l1, l2 = load_rotations(path, cfg)
    assert torch.allclose(l1, r1, atol=1e-6) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(l2, r2, strict=True))


def test_rbin_rotation_preserves_logits(tmp_path):
    loaded = tiny_model("qwen2")
    save_rotations(tmp_path / "R.bin", *random_rotations(loaded.model.config, seed=5))
    x = torch.randint(0, 384, (1, 32))
    ref = loaded.model(x).logits
    quantize(loaded, QuantRecipe(rotation=str(tmp_path / "R.bin"), w_bits=16, a_bits=16, embedding_bits=16,
                                 lm_head_bits=16), progress=False)
    assert ((loaded.model(x).logits - ref).norm() / ref.norm()).item() < 1e-4


def test_wrong_shape_and_non_orthogonal_are_clear_errors(tmp_path):
    cfg = tiny_model("llama").model.config
    r1, r2 = random_rotations(cfg)
    save_rotations(tmp_path / "shape.bin", torch.eye(64), r2)
    with pytest.raises(SpinQuantError, match=r"R1 has shape \(64, 64\), expected \(96, 96\)"):
        load_rotations(tmp_path / "shape.bin", cfg)
    save_rotations(tmp_path / "skew.bin", r1 * 1.01, r2)
    with pytest.raises(SpinQuantError, match="R1 is not orthogonal"):
        load_rotations(tmp_path / "skew.bin", cfg)
