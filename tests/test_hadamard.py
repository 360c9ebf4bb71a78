import math

import pytest
import torch

from spinquant_et.errors import SpinQuantError
from spinquant_et.hadamard import HadamardTransform, hadamard_factors, hadamard_matrix, random_hadamard_matrix

LISTED_K = [12, 20, 28, 36, 40, 44, 52, 60, 108, 140]


@pytest.mark.parametrize("k", LISTED_K + [312, 344])
def test_base_matrices_are_hadamard(k):
    factors = hadamard_factors(k)
    h = hadamard_matrix(k) * math.sqrt(k)
    assert torch.equal(h.abs().round(), torch.ones(k, k, dtype=h.dtype)), "entries must be +-1"
    assert torch.allclose(h @ h.T, k * torch.eye(k, dtype=h.dtype)), factors


@pytest.mark.parametrize("n", [64, 96, 160, 576, 1536, 896, 4864, 312 * 2, 344 * 4])
def test_transform_equals_dense_orthonormal_matrix(n):
    h = hadamard_matrix(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=h.dtype), atol=1e-12)
    x = torch.randn(3, 5, n, dtype=torch.float64)
    assert torch.allclose(HadamardTransform(n).double()(x), x @ h.T, atol=1e-12)


def test_llama2_intermediate_11008_is_supported_without_dense_matrix():
    n = 11008
    t = HadamardTransform(n).double()
    assert t.factors[0] == 344
    x = torch.randn(4, n, dtype=torch.float64)
    assert torch.allclose(t(x).norm(dim=-1), x.norm(dim=-1))  # norm-preserving
    cols = t(torch.eye(n, dtype=torch.float64)[:16])  # 16 columns of H
    assert torch.allclose(cols.abs(), torch.full_like(cols, 1 / math.sqrt(n)))  # flat: a Hadamard matrix
    assert torch.allclose(cols @ cols.T, torch.eye(16, dtype=torch.float64), atol=1e-12)


def test_online_transform_cost_is_small_per_element():
    for n in (576, 1536, 14336):
        assert sum(hadamard_factors(n)) <= 200  # vs n multiply-adds per element for a dense matmul


@pytest.mark.parametrize("n", [172, 156, 14])
def test_unbuildable_size_is_a_clear_error(n):
    with pytest.raises(SpinQuantError, match="no Hadamard matrix of order"):
        hadamard_factors(n)


def test_random_hadamard_is_orthogonal_and_seeded():
    a = random_hadamard_matrix(576, torch.Generator().manual_seed(1))
    b = random_hadamard_matrix(576, torch.Generator().manual_seed(1))
    c = random_hadamard_matrix(576, torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.allclose(a @ a.T, torch.eye(576, dtype=a.dtype), atol=1e-12)
