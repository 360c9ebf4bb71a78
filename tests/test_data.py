import pytest
import torch

from spinquant_et.data import builtin_text, calibration_samples, load_text, token_windows
from spinquant_et.errors import SpinQuantError


def test_builtin_text_has_disjoint_train_and_test_parts():
    train, test = builtin_text("train"), builtin_text("test")
    assert len(train) > 200_000 and len(test) > 100_000
    assert test[:2000] not in train


def test_windows_are_non_overlapping_and_in_order():
    ids = torch.arange(1000)
    w = token_windows(ids, 128, 5)
    assert w.shape == (5, 128) and torch.equal(w.flatten(), ids[:640])
    assert token_windows(ids, 128).shape == (7, 128)  # all that fit


def test_too_short_text_is_a_clear_error():
    with pytest.raises(SpinQuantError, match="fewer than one window of 512"):
        token_windows(torch.arange(100), 512)


def test_calibration_samples_are_reproducible_by_seed():
    ids = torch.arange(10_000)
    a, b, c = (calibration_samples(ids, 64, 8, seed=s) for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(8, 63, dtype=torch.long))  # contiguous windows


def test_missing_text_file_is_a_clear_error(tmp_path):
    with pytest.raises(SpinQuantError, match="text file not found"):
        load_text(tmp_path / "nope.txt")
