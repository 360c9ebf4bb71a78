"""Hadamard matrices of order K * 2^k, and a fast transform with them.

Powers of two come from Sylvester's construction. Other orders come from Paley's constructions
over the finite field GF(q), q a prime power, built at run time (nothing is stored as literals):

* Paley I:  order q + 1,       q = 3 (mod 4)   e.g. 12 (11), 20 (19), 44, 60, 108, 140, 344 (7^3)
* Paley II: order 2 (q + 1),   q = 1 (mod 4)   e.g. 28 (13), 36 (17), 52 (25 = 5^2), 76 (37)

Together with Kronecker products these cover every K * 2^k with K in {1, 12, 20, 28, 36, 40, 44,
52, 60, 108, 140}, and 156 * 2^k, 172 * 2^k for k >= 1 (312 = 311 + 1, 344 = 7^3 + 1; Llama-2's
11008 = 344 * 32). SmolLM2 needs 576 = 36 * 16 and 1536 = 12 * 128.

The transform never forms the n x n matrix: ``x @ H^T`` is applied one Kronecker factor at a time
(``O(n * sum(factors))``), with plain matmul/transpose/reshape so it lowers to XNNPACK.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .errors import SpinQuantError

# Largest power-of-two Kronecker factor of the online transform. At decode time each factor costs
# a transpose and a kernel launch, which outweigh its multiply-adds: 128 gives head_dim 64 one
# factor and 1536 = 12 x 128 two (140 multiply-adds per element, vs 1536 for a dense matmul).
MAX_POW2_FACTOR = 128


def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, m) with q = p^m and p prime, or None."""
    if q < 2:
        return None
    p = next(d for d in range(2, q + 1) if q % d == 0)
    m = 0
    while q % p == 0:
        q //= p
        m += 1
    return (p, m) if q == 1 else None


def _poly_mod(a: list[int], f: list[int], p: int) -> list[int]:
    """a mod f over GF(p); polynomials as coefficient lists, lowest degree first, f monic."""
    a = a[:]
    while len(a) >= len(f):
        c = a[-1]
        if c:
            shift = len(a) - len(f)
            for i, fc in enumerate(f):
                a[shift + i] = (a[shift + i] - c * fc) % p
        a.pop()
    return a


def _irreducible(p: int, m: int) -> list[int]:
    """The first monic irreducible polynomial of degree m over GF(p) (brute force, tiny m)."""

    def monic(deg: int):
        for n in range(p**deg):
            yield [(n // p**i) % p for i in range(deg)] + [1]

    for f in monic(m):
        if all(any(_poly_mod(f, g, p)) for d in range(1, m // 2 + 1) for g in monic(d)):
            return f
    raise AssertionError(f"no irreducible polynomial of degree {m} over GF({p})")


def _quadratic_character_table(q: int) -> np.ndarray:
    """chi[i - j] for all elements i, j of GF(q) (elements numbered by their base-p digits)."""
    p, m = _prime_power(q)  # type: ignore[misc]
    digits = np.array([[(n // p**i) % p for i in range(m)] for n in range(q)])
    f = _irreducible(p, m) if m > 1 else [0, 1]
    squares = set()
    for n in range(1, q):
        a = list(digits[n])
        prod = [0] * (2 * m - 1)
        for i, ai in enumerate(a):
            for j, aj in enumerate(a):
                prod[i + j] = (prod[i + j] + ai * aj) % p
        r = _poly_mod(prod, f, p) if m > 1 else [prod[0] % p]
        squares.add(sum(int(c) * p**i for i, c in enumerate(r)))
    chi = np.array([0] + [1 if n in squares else -1 for n in range(1, q)])
    diff = (digits[:, None, :] - digits[None, :, :]) % p
    return chi[diff @ (p ** np.arange(m))]


def _paley(n: int) -> np.ndarray | None:
    """An unnormalized Hadamard matrix of order n from Paley I or II, or None."""
    q = n - 1
    if _prime_power(q) and q % 4 == 3:
        s = np.zeros((n, n), dtype=np.int64)
        s[0, 1:] = 1
        s[1:, 0] = -1
        s[1:, 1:] = _quadratic_character_table(q)
        return s + np.eye(n, dtype=np.int64)
    q = n // 2 - 1
    if n % 4 == 0 and _prime_power(q) and q % 4 == 1:
        c = np.zeros((q + 1, q + 1), dtype=np.int64)
        c[0, 1:] = 1
        c[1:, 0] = 1
        c[1:, 1:] = _quadratic_character_table(q)
        return np.kron(c, [[1, 1], [1, -1]]) + np.kron(np.eye(q + 1, dtype=np.int64), [[1, -1], [-1, -1]])
    return None


@functools.lru_cache(maxsize=None)
def _base_matrix(n: int) -> np.ndarray:
    """Unnormalized Hadamard matrix for one Kronecker factor (a power of two or a Paley order)."""
    if n & (n - 1) == 0:
        h = np.ones((1, 1), dtype=np.int64)
        while h.shape[0] < n:
            h = np.block([[h, h], [h, -h]])
        return h
    h = _paley(n)
    if h is None:
        raise AssertionError(f"{n} is not a Paley order")
    assert (h @ h.T == n * np.eye(n, dtype=np.int64)).all(), f"Paley construction failed for {n}"
    return h


def _is_base_order(n: int) -> bool:
    return n & (n - 1) == 0 or _paley(n) is not None


@functools.lru_cache(maxsize=None)
def hadamard_factors(n: int) -> tuple[int, ...]:
    """Orders of small Hadamard matrices whose Kronecker product has order n.

    One non-power-of-two factor K (the smallest that works), then powers of two of at most
    ``MAX_POW2_FACTOR``. Raises SpinQuantError for sizes with no known construction here.
    """
    if n < 1:
        raise SpinQuantError(f"Hadamard size must be positive, got {n}")
    pow2 = n & -n
    odd = n // pow2
    k = 1
    if odd > 1:
        candidates = [odd * 2**b for b in range(int(math.log2(pow2)) + 1)]
        k = next((c for c in candidates if _paley(c) is not None), 0)
        if not k:
            raise SpinQuantError(
                f"no Hadamard matrix of order {n} = {odd} * {pow2} can be built here (needs a Paley "
                f"order {odd}*2^j); use --rotation none or a model whose dimensions are K*2^k with "
                "K in 1, 12, 20, 28, 36, 40, 44, 52, 60, 108, 140"
            )
    rest = n // k
    factors = [k] if k > 1 else []
    while rest > 1:
        f = min(rest, MAX_POW2_FACTOR)
        factors.append(f)
        rest //= f
    return tuple(factors) or (1,)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal Hadamard matrix of order n (dense; for offline rotations and tests)."""
    h = np.ones((1, 1), dtype=np.float64)
    for f in hadamard_factors(n):
        h = np.kron(h, _base_matrix(f))
    return torch.from_numpy(h / math.sqrt(n)).to(dtype)


def random_hadamard_matrix(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``diag(s) @ H`` with random signs s: an orthogonal matrix with flat (incoherent) rows."""
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64).double() * 2 - 1
    return signs[:, None] * hadamard_matrix(n)


class HadamardTransform(nn.Module):
    """``y = x @ H^T`` over the last dimension, one Kronecker factor at a time.

    Uses the optional CUDA kernel of ``fast-hadamard-transform`` for power-of-two sizes on GPU.
    """

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.factors = hadamard_factors(n)
        for i, f in enumerate(self.factors):
            self.register_buffer(f"h{i}", torch.from_numpy(_base_matrix(f) / math.sqrt(f)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.n & (self.n - 1) == 0:
            try:
                from fast_hadamard_transform import hadamard_transform

                return hadamard_transform(x, scale=1.0 / math.sqrt(self.n))
            except ImportError:
                pass
        # Reshapes name every dimension but one inferred (-1): the form torch.export keeps static
        # and XNNPACK delegates (it rejects symbolic reshapes).
        out_shape = [d if isinstance(d, int) else -1 for d in x.shape]
        if out_shape.count(-1) > 1:
            out_shape = list(x.shape)
        if len(self.factors) == 1:  # one factor: a plain matmul over the last dim, no reshapes
            return F.linear(x, self.h0.to(x.dtype))
        y = x.reshape(-1, self.n)
        for i, f in enumerate(self.factors):
            # [rows, f, rest] -> [rows, rest, f] @ H_f^T: H_f applied to the f axis, which ends up last.
            y = F.linear(y.reshape(-1, f, self.n // f).transpose(1, 2), getattr(self, f"h{i}").to(y.dtype))
            y = y.reshape(-1, self.n)
        return y.reshape(out_shape)

    def extra_repr(self) -> str:
        return f"n={self.n}, factors={self.factors}"
