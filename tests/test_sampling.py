"""Sampling with llama.cpp's controls (spinquant_et/sampling.py): each control does what llama-cli's does,
draws follow the distribution they should, and bad values get one-line errors. The C++ runner's equal
tokens for a seed are checked in test_runner.py."""

from __future__ import annotations

import numpy as np
import pytest

from spinquant_et.errors import SpinQuantError
from spinquant_et.sampling import SamplingConfig, SplitMix64, sample_token


def test_splitmix64_matches_the_reference_sequence():
    # Vigna's splitmix64.c from state 0; the C++ runner's generator is the same few lines
    rng = SplitMix64(0)
    assert [rng.next_u64() for _ in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    u = [SplitMix64(s).uniform() for s in range(1000)]
    assert 0 <= min(u) and max(u) < 1 and abs(np.mean(u) - 0.5) < 0.03


def test_greedy_is_the_argmax_and_ties_take_the_lowest_id():
    logits = np.array([0.5, 2.0, 2.0, -1.0], dtype=np.float32)
    assert sample_token(logits, SamplingConfig(), None) == 1


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    """llama.cpp: a recent token's logit l becomes l / p when l > 0, else l * p; once per distinct token."""
    logits = np.array([3.0, 2.9, -0.1, -0.2], dtype=np.float32)
    penalized = SamplingConfig(repeat_penalty=2.0)
    assert sample_token(logits, penalized, None, history=[0]) == 1  # 3.0 / 2 = 1.5 < 2.9
    assert sample_token(logits, penalized, None, history=[0, 0, 0]) == 1  # not 3.0 / 8
    assert sample_token(logits, penalized, None, history=[0, 1]) == 0  # 1.5 > 1.45
    neg = np.array([-1.0, -1.5, -3.0], dtype=np.float32)
    assert sample_token(neg, penalized, None, history=[0]) == 1  # -1.0 * 2 = -2.0 < -1.5
    # only the last repeat_last_n tokens count
    assert sample_token(logits, SamplingConfig(repeat_penalty=2.0, repeat_last_n=1), None, history=[0, 3]) == 0


def test_truncations_keep_what_llama_cpp_keeps():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    hot = dict(temperature=1.0, top_p=1.0)

    def support(**kw) -> set[int]:
        rng = SplitMix64(1)
        return {sample_token(logits, SamplingConfig(**{**hot, **kw}), rng) for _ in range(400)}

    assert support() == {0, 1, 2, 3}
    assert support(top_k=2) == {0, 1}
    assert support(top_p=0.75) == {0, 1}  # 0.5 + 0.3 is the first prefix to reach 0.75
    assert support(top_p=0.85) == {0, 1, 2}
    assert support(min_p=0.5) == {0, 1}  # 0.3 >= 0.5 * 0.5; 0.15 is not
    assert support(top_k=1) == {0}


def test_draws_follow_the_tempered_distribution():
    """20000 draws at temperature 0.7: each token's frequency within 4 standard errors of softmax(l / T)."""
    logits = np.array([1.0, 0.5, 0.0, -1.0, 2.0], dtype=np.float32)
    config = SamplingConfig(temperature=0.7, top_p=1.0, seed=5)
    rng = SplitMix64(config.seed)
    n = 20000
    counts = np.bincount([sample_token(logits, config, rng) for _ in range(n)], minlength=5)
    p = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    se = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(counts / n - p) < 4 * se + 1e-9), (counts / n, p)


def test_the_same_seed_draws_the_same_tokens():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    config = SamplingConfig(temperature=1.0, top_k=50, min_p=0.01, seed=11)
    runs = [[sample_token(logits, config, rng) for _ in range(20)] for rng in (SplitMix64(11), SplitMix64(11))]
    assert runs[0] == runs[1] and len(set(runs[0])) > 5


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -1.0, "--temperature must be >= 0"),
    ("top_k", -2, "--top-k must be >= 0"),
    ("top_p", 0.0, "--top-p must be in (0, 1]"),
    ("min_p", 1.0, "--min-p must be in [0, 1)"),
    ("repeat_penalty", 0.0, "--repeat-penalty must be > 0"),
])
def test_bad_values_are_one_line_errors(field, value, message):
    with pytest.raises(SpinQuantError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingConfig(**{field: value})
