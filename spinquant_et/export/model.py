"""The exportable model: a flat Llama block with a static KV cache, built from a quantized checkpoint.

gpt-fast style: one file, one ``ExportArgs`` dataclass, HF weight layout kept as is (q/k stay in
HF's rotate-half RoPE layout, so no permutation is needed here; ``convert`` permutes for Meta's
layout). What makes it ours:

* linears hold the checkpoint's integers untouched (``Int8DynActInt4WeightLinear``: int8 buffer
  with int4 values, fp32 group scales, zero points 0) so XNNPACK runs exactly the
  weights GPTQ/clipped RTN chose; lm_head is int8 per channel with int8 dynamic activations;
  embeddings are an int8 gather times per-row scales (plain aten ops);
* R3 (Hadamard on Q and K after RoPE) and R4 (Hadamard before down_proj) are in the graph as
  Kronecker-factor matmuls, which XNNPACK runs for every size;
* the KV cache lives in mutable buffers (float, or int8 with per token/head scale and zero point),
  attention is plain SDPA over the whole cache with a causal mask: only standard operators, so
  the ``.pte`` runs in any ExecuTorch runtime (no ``llama::*`` custom ops).

``forward(tokens [1, T] int64, input_pos [1] int64) -> logits [1, vocab]`` (last position), the
signature ExecuTorch's LLM runners call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..hadamard import HadamardTransform

# Integer conventions shared with the fake-quant model (spinquant_et.quant.quantizer).
ACT_QMIN, ACT_QMAX = -128, 127


@dataclass
class ExportArgs:
    vocab_size: int
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    max_seq_len: int
    w_bits: int = 4  # 4: 8da4w linears; 16: float linears
    group_size: int = 32
    a_bits: int = 8
    kv_bits: int = 16  # 8: int8 KV cache
    lm_head_bits: int = 8
    embedding_bits: int = 8
    rotated: bool = True  # R3 and R4 online
    qkv_bias: bool = False
    qk_norm: bool = False
    ops: str = "portable"  # "et-llama": ExecuTorch's llama::update_cache / llama::custom_sdpa (float cache)
    near_len: int = 0  # > 0: a copy of the cache's first near_len positions that forward_near reads in place


class RMSNorm(nn.Module):
    """RMSNorm whose mean of squares is a ``[1, dim]`` linear: XNNPACK delegates ``linear`` but not a
    last-dim ``mean`` (it only pools 4-D inputs), and every op it cannot take splits the graph."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.unit_weight = False
        self.register_buffer("mean_row", torch.full((1, dim), 1.0 / dim), persistent=False)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` over its root mean square, before the weight."""
        return x * torch.rsqrt(F.linear(x * x, self.mean_row) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.normalize(x)
        # A weight fused into the linears that read this norm (SpinQuant's norm fusion) is all ones: no
        # multiply then (one XNNPACK operator less to re-plan per call).
        return y if self.unit_weight else y * self.weight

    def load_weight(self, weight: torch.Tensor) -> "RMSNorm":
        """Set the weight (a plain flag decides the multiply: export traces it as a constant)."""
        with torch.no_grad():
            self.weight.copy_(weight.float())
        self.unit_weight = bool(torch.all(self.weight == 1))
        return self


def _dynamic_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    """int8 per-token asymmetric quantize->dequantize (XNNPACK fuses it into its QD8 kernels).

    ``quantized_decomposed`` ops, not torchao's ``*_affine`` ones: same arithmetic, but lowering
    traces them several times faster (they have light meta kernels), which matters at 30 layers.
    """
    qd = torch.ops.quantized_decomposed
    scale, zero = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
    xq = qd.quantize_per_token(x, scale, zero, ACT_QMIN, ACT_QMAX, torch.int8)
    return qd.dequantize_per_token(xq, scale, zero, ACT_QMIN, ACT_QMAX, torch.int8, torch.float32)


class Int8DynActInt4WeightLinear(nn.Module):
    """int4 groupwise weights (int8 storage, zero points 0) with int8 dynamic per-token activations:
    XNNPACK's QD8 x QB4W kernels. The integers are the checkpoint's, never re-rounded."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.group_size = weight.shape[1] // scales.shape[1]
        self.register_buffer("weight", weight.to(torch.int8))
        self.register_buffer("scales", scales.float())
        self.register_buffer("zeros", torch.zeros_like(self.scales, dtype=torch.int8))
        self.register_buffer("bias", None if bias is None else bias.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.ops.quantized_decomposed.dequantize_per_channel_group(
            self.weight, self.scales, self.zeros, -8, 7, torch.int8, self.group_size, torch.float32
        )
        return F.linear(_dynamic_quant_per_token(x), w, self.bias)


class Int8DynActInt8WeightLinear(nn.Module):
    """int8 per-channel weights with int8 dynamic per-token activations (XNNPACK QD8 x QC8W)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.to(torch.int8))
        self.register_buffer("scales", scales.reshape(-1).float())
        self.register_buffer("zeros", torch.zeros_like(self.scales, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.ops.quantized_decomposed.dequantize_per_channel(
            self.weight, self.scales, self.zeros, 0, ACT_QMIN, ACT_QMAX, torch.int8
        )
        return F.linear(_dynamic_quant_per_token(x), w)


class Int8Embedding(nn.Module):
    """int8 rows times a per-row scale: a gather and a multiply, no quantized kernel needed."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.to(torch.int8))
        self.register_buffer("scales", scales.reshape(-1, 1).float())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight).to(torch.float32) * F.embedding(tokens, self.scales)


def make_linear(weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None) -> nn.Module:
    """8da4w (integers kept as given) when quantized, else a float linear."""
    if scales is None:
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None).requires_grad_(False)
        lin.weight.data = weight.float()
        if bias is not None:
            lin.bias.data = bias.float()
        return lin
    return Int8DynActInt4WeightLinear(weight, scales, bias)


def rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """``P`` with ``F.linear(x, P) == cat(-x2, x1)`` (HF's rotate_half) as one delegated linear."""
    half = head_dim // 2
    p = torch.zeros(head_dim, head_dim)
    p[torch.arange(half), torch.arange(half) + half] = -1.0
    p[torch.arange(half) + half, torch.arange(half)] = 1.0
    return p


NEAR = "near"  # attention's window: the near cache (KVCache), not a prefix of the whole cache


class KVCache(nn.Module):
    """Static cache ``[kv_heads, max_seq, head_dim]``; int8 with per token/head scale and zero point if 8-bit.

    The int8 path uses ``quantized_decomposed`` per-token ops (ExecuTorch's quantized kernels, as in
    its own quantized KV cache): single portable nodes between XNNPACK partitions. Spelled out in
    aten ops, half of them would be delegated and the partitioner finds dependency cycles.

    With ``near_len`` N, every write also goes to a second cache of N + 1 positions: positions below N
    land there at their index, later ones on row N, which no query sees (its column is masked: a
    near read happens only while every position is below N). Attention over that cache reads it in
    place, where a window of the full cache would be a copy: ExecuTorch has no strided views. SmolLM2,
    decode steps at positions 128-255 of a 2048 cache: 6.1 ms through forward_near, 8.2 through
    forward_ctx's window. The second write costs one small index_put per tensor; forward_near writes
    only the near cache, and ``spill_near`` brings the cache up to date when a method that reads it
    follows (an int8 cache then quantizes nothing per decode step but what the near cache needs).
    """

    def __init__(self, args: ExportArgs):
        super().__init__()
        # [kv_heads, max_seq, head_dim]: positions on dim 1, the layout ExecuTorch's in-place index_put_
        # kernel accepts (so a token's K/V is written in place, not a copy of the cache per step).
        # et-llama: [1, max_seq, kv_heads, head_dim], the layout llama::update_cache/custom_sdpa take.
        shape = (args.n_kv_heads, args.max_seq_len, args.head_dim)
        if args.ops == "et-llama":
            shape = (1, args.max_seq_len, args.n_kv_heads, args.head_dim)
        self.quantized = args.kv_bits == 8
        self.near_len = args.near_len
        self._stored = self._register("", shape, self.quantized)
        if self.near_len:
            self._stored_near = self._register("near_", (shape[0], self.near_len + 1, shape[2]), False)

    def _register(self, prefix: str, shape, quantized: bool) -> list[str]:
        """Buffers of one cache; names in the order ``_quantize`` returns its parts (k's, then v's)."""
        dtype = torch.int8 if quantized else torch.float32
        names = []
        for kv in ("k", "v"):
            self.register_buffer(prefix + kv, torch.zeros(shape, dtype=dtype), persistent=False)
            names.append(prefix + kv)
            if quantized:
                qshape = (*shape[:-1], 1)
                # float64 scales: ExecuTorch's per-token quantize kernel requires double
                self.register_buffer(f"{prefix}{kv}_scale", torch.ones(qshape, dtype=torch.float64), persistent=False)
                self.register_buffer(f"{prefix}{kv}_zero", torch.zeros(qshape, dtype=torch.int64), persistent=False)
                names += [f"{prefix}{kv}_scale", f"{prefix}{kv}_zero"]
        return names

    @staticmethod
    def _quantize(x: torch.Tensor):
        qd = torch.ops.quantized_decomposed
        scale, zero = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
        return qd.quantize_per_token(x, scale, zero, ACT_QMIN, ACT_QMAX, torch.int8), scale, zero

    @staticmethod
    def _dequantize(q, scale, zero):
        return torch.ops.quantized_decomposed.dequantize_per_token(q, scale, zero, ACT_QMIN, ACT_QMAX, torch.int8,
                                                                   torch.float32)

    def _write(self, names: list[str], pos: torch.Tensor, parts) -> None:
        for name, part in zip(names, parts, strict=True):
            getattr(self, name)[:, pos] = part  # index_put_ on the buffer: in place (run_reinplace_pass)

    def spill_near(self) -> None:
        """Write the near cache's positions into the cache: forward_near skips the cache (SmolLM2, int8
        cache: a decode step's six int8 writes per layer), so runners call this once before a method that
        reads the cache follows forward_near steps. An int8 cache gets the near cache's values quantized
        again: they are already on the grid of their scale and zero point, so the integers come back the
        same and the scales equal to float rounding (tested)."""
        n = self.near_len
        k, v = self.near_k[:, :n], self.near_v[:, :n]
        parts = (k, v) if not self.quantized else (*self._quantize(k), *self._quantize(v))
        self._write(self._stored, torch.arange(n), parts)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window=None, near_pos=None):
        """Write ``k, v [kv_heads, t, head_dim]`` at positions ``pos`` (rows ``near_pos`` of the near cache);
        return what attention reads: the whole cache (``window`` None), its first ``window`` positions
        (forward_ctx's symbolic context length) or the near cache (``NEAR``), dequantized when int8.

        The near cache is float even beside an int8 cache: it holds the new K/V quantized and dequantized
        at once, exactly what a later dequantize of the int8 cache returns, so forward_near reads it with no
        per-step dequantize of every position (ExecuTorch's portable kernel; XNNPACK takes no int8 -> float
        cast). That costs (near_len + 1) x 4 bytes per cached value, fixed, where the int8 cache that follows
        --max-seq-len keeps its 1 byte."""
        near = window is NEAR
        if not self.quantized:
            parts = near_parts = (k, v)
        else:
            qk, qv = self._quantize(k), self._quantize(v)
            parts, near_parts = (*qk, *qv), (self._dequantize(*qk), self._dequantize(*qv))
        if not near:  # forward_near writes the near cache alone; spill_near copies it into the cache later
            self._write(self._stored, pos, parts)
        if self.near_len:
            self._write(self._stored_near, near_pos, near_parts)
            if near:
                return self.near_k, self.near_v

        def read(name):  # a window of the cache is a copy of those positions (cost follows the context)
            t = getattr(self, name)
            return t if window is None else t.narrow(1, 0, window)

        if not self.quantized:
            return read("k"), read("v")
        return self._dequantize(*map(read, self._stored[:3])), self._dequantize(*map(read, self._stored[3:]))


class _Holder(nn.Module):
    def __init__(self, **children: nn.Module):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class NearSpill(nn.Module):
    """The ``spill_near`` method: every layer's ``KVCache.spill_near``. It holds the model's caches under
    the model's own names (``layers.N.attention.cache.*``) and nothing else: a program's methods share
    mutable buffers by name, and no weight is traced into this method."""

    def __init__(self, model: "Transformer"):
        super().__init__()
        self.layers = nn.ModuleList(_Holder(attention=_Holder(cache=layer.attention.cache)) for layer in model.layers)

    def forward(self) -> None:
        for layer in self.layers:
            layer.attention.cache.spill_near()


class HeadNorm(nn.Module):
    """Qwen3's per-head RMSNorms of q and k on the stacked ``[1, t, heads, head_dim]`` q/k/v tensor: q
    heads get q_norm's weight, k heads k_norm's, and v heads pass through unchanged (``mask`` 0)."""

    def __init__(self, q_norm: RMSNorm, k_norm: RMSNorm, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.norm = q_norm  # its normalize(): eps and head_dim are q_norm's and k_norm's alike
        hd = q_norm.weight.shape[0]
        ones = torch.ones(n_kv_heads, hd)
        self.register_buffer("weight", torch.cat([q_norm.weight.detach().expand(n_heads, hd),
                                                  k_norm.weight.detach().expand(n_kv_heads, hd), ones]))
        mask = torch.zeros(n_heads + 2 * n_kv_heads, 1)
        mask[: n_heads + n_kv_heads] = 1.0
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm.normalize(x) * self.weight * self.mask + x * (1.0 - self.mask)


class Attention(nn.Module):
    """q, k and v come from one stacked linear and get RoPE (and R3) as one tensor: v's rows of the
    cos/sin tables are 1/0, so RoPE leaves v as it is (exactly), and R3 is a per-head matrix that is the
    identity on v. Fewer, larger XNNPACK operators: a decode step's cost beyond its matmuls is XNNPACK
    re-planning every operator of the graph on every call (about 1 us each), so the operator count
    matters (SmolLM2 W4A8 R1-R4: 0.951x the decode step of separate q/k/v linears). ``view(.., -1, ..)`` keeps one
    inferred dimension, the form XNNPACK delegates; after a permute torch.export writes ``reshape``'s -1
    as a symbolic size, which XNNPACK refuses, and the graph is cut there."""

    def __init__(self, args: ExportArgs, wqkv, wo, head_norm: HeadNorm | None = None):
        super().__init__()
        self.args = args
        self.wqkv, self.wo = wqkv, wo
        self.head_norm = head_norm
        hd, nh, kvh = args.head_dim, args.n_heads, args.n_kv_heads
        self.heads = nh + 2 * kvh
        # R3 leaves Q K^T unchanged, so it only matters when the cache is quantized: with a float
        # cache it would be a matmul per layer that changes nothing.
        # It is one linear on every head (XNNPACK packs its constant weight once; a batched matmul with
        # one matrix per head packed it on every call: 13 us against 3 per layer, SmolLM2), kept on q and
        # k heads and dropped on v heads by a 0/1 mask per head (exact: x * 1 + y * 0).
        r3 = qk_heads = None
        if args.rotated and args.kv_bits < 16:
            r3 = HadamardTransform(hd).float()(torch.eye(hd)).t().contiguous()  # F.linear(x, r3) = H x
            qk_heads = (torch.arange(self.heads) < nh + kvh).float().view(self.heads, 1)
        self.register_buffer("r3", r3, persistent=False)
        # both masks stored: `1 - keep` in forward would be one more graph op per layer
        self.register_buffer("r3_keep", qk_heads, persistent=False)
        self.register_buffer("r3_skip", None if qk_heads is None else 1.0 - qk_heads, persistent=False)
        self.cache = KVCache(args)
        self.n_rep = nh // kvh
        self.register_buffer("rot_half", rotate_half_matrix(hd), persistent=False)

    def _qkv(self, x, cos, sin):
        """q, k, v ``[heads, t, head_dim]`` stacked on the heads axis, RoPE (and R3) applied to q and k."""
        qkv = self.wqkv(x).view(1, -1, self.heads, self.args.head_dim)
        if self.head_norm is not None:
            qkv = self.head_norm(qkv)
        qkv = qkv * cos + F.linear(qkv, self.rot_half) * sin  # cos/sin [t, heads, hd]
        if self.r3 is not None:
            qkv = F.linear(qkv, self.r3) * self.r3_keep + qkv * self.r3_skip
        return qkv.view(-1, self.heads, self.args.head_dim).transpose(0, 1).contiguous()  # [heads, t, hd]

    def forward(self, x, cos, sin, pos, mask, window=None, near_pos=None):
        if self.args.ops == "et-llama":
            return self._forward_et_llama(x, cos, sin, pos)
        a = self.args
        hd, kvh, nh = a.head_dim, a.n_kv_heads, a.n_heads
        qkv = self._qkv(x, cos, sin)
        q, k, v = qkv[:nh], qkv[nh:nh + kvh], qkv[nh + kvh:]
        keys, values = self.cache.update(pos, k, v, window, near_pos)  # [kv, n, hd]
        # GQA without copying the cache: fold each kv head's query heads into the row axis.
        q = q.view(kvh, -1, hd)  # [kv, rep * t, hd]
        scores = torch.bmm(q, keys.transpose(1, 2)) + mask  # q arrives scaled by 1/sqrt(head_dim) (Transformer)
        out = torch.bmm(torch.softmax(scores, dim=-1), values)
        # reshape, not contiguous().view(): its symbolic size keeps o_proj out of the attention's XNNPACK
        # partition, which measured faster than one partition per layer (XNNPACK re-plans a partition on
        # every call, and that cost grows faster than its operator count).
        out = out.view(kvh, self.n_rep, -1, hd).permute(2, 0, 1, 3).reshape(1, -1, nh * hd)
        return self.wo(out)

    def _forward_et_llama(self, x, cos, sin, pos):
        """ExecuTorch's custom ops: the cache update is in place and attention stops at the current
        position instead of reading the whole cache (float cache only; R3 is then not needed)."""
        a = self.args
        hd, kvh, nh = a.head_dim, a.n_kv_heads, a.n_heads
        qkv = self.wqkv(x).view(1, -1, self.heads, hd)  # [1, t, heads, hd]: the custom ops' layout
        if self.head_norm is not None:
            qkv = self.head_norm(qkv)
        qkv = qkv * cos + F.linear(qkv, self.rot_half) * sin
        q, k, v = qkv[:, :, :nh], qkv[:, :, nh:nh + kvh], qkv[:, :, nh + kvh:]
        start = pos[0].item()
        torch._check_is_size(start)
        torch._check(start < a.max_seq_len)
        torch.ops.llama.update_cache(k, self.cache.k, start)
        torch.ops.llama.update_cache(v, self.cache.v, start)
        out = torch.ops.llama.custom_sdpa(q, self.cache.k, self.cache.v, start, None, 0, True)  # GQA inside
        return self.wo(out.reshape(1, -1, nh * hd))


class TransposedInputKronHadamard(nn.Module):
    """R4 for ``n = a * b`` with one transpose: ``x`` arrives in ``(b, a)`` channel order (gate/up rows
    were permuted offline by ``input_permutation``), H_a is applied on the last axis, one transpose
    restores ``(a, b)`` order, H_b goes on the last axis. Output: ``H x`` in the natural order."""

    def __init__(self, factors: tuple[int, int]):
        super().__init__()
        self.a, self.b = factors
        full = HadamardTransform(self.a * self.b)
        self.register_buffer("ha", full.h0.float(), persistent=False)
        self.register_buffer("hb", full.h1.float(), persistent=False)

    @staticmethod
    def input_permutation(a: int, b: int) -> torch.Tensor:
        """New channel ``j = i2 * a + i1`` holds old channel ``i1 * b + i2``."""
        return torch.arange(a * b).view(a, b).t().reshape(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.reshape(-1, self.b, self.a), self.ha).transpose(1, 2)
        return F.linear(y, self.hb).reshape(1, -1, self.a * self.b)


class FeedForward(nn.Module):
    def __init__(self, args: ExportArgs, w13, w2, r4: nn.Module | None = None):
        super().__init__()
        self.hidden_dim = args.hidden_dim
        # gate and up stacked (one kernel), down (Meta names w1, w3, w2). The two halves of w13's output
        # are slices XNNPACK does not take (dynamic token dimension), so the graph is cut there; as two
        # linears the layer is one partition, and that measured 6% slower (8-layer SmolLM2 shape, decode).
        self.w13, self.w2 = w13, w2
        self.r4 = r4

    def forward(self, x):
        gate_up = self.w13(x)
        h = F.silu(gate_up[..., : self.hidden_dim]) * gate_up[..., self.hidden_dim :]
        if self.r4 is not None:
            h = self.r4(h)
        return self.w2(h)


class Block(nn.Module):
    def __init__(self, args: ExportArgs, attention: Attention, feed_forward: FeedForward):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention, self.feed_forward = attention, feed_forward

    def forward(self, x, cos, sin, pos, mask, window=None, near_pos=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, pos, mask, window, near_pos)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ExportArgs, tok_embeddings: nn.Module, layers: list[Block], output: nn.Module,
                 cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        self.args = args
        self.tok_embeddings = tok_embeddings
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = output
        self.register_buffer("cos", cos, persistent=False)  # [max_seq, head_dim]
        self.register_buffer("sin", sin, persistent=False)
        # Per head, what RoPE's tables are multiplied by: attention's 1/sqrt(head_dim) for q heads (RoPE
        # and R3 are linear, so the scores come out scaled without a multiply per layer; exact for a
        # power-of-4 head_dim), 1 for k heads, 0 for v heads, whose cos is then set to 1 (see Attention).
        # ExecuTorch's custom_sdpa (et-llama) scales itself.
        n = args.n_heads + 2 * args.n_kv_heads
        q_scale = args.head_dim**-0.5 if args.ops != "et-llama" else 1.0
        rope_heads = torch.tensor([q_scale] * args.n_heads + [1.0] * args.n_kv_heads + [0.0] * args.n_kv_heads)
        self.register_buffer("rope_heads", rope_heads.view(n, 1), persistent=False)
        self.register_buffer("v_heads", (rope_heads == 0).float().view(n, 1), persistent=False)
        # forward_near is forward traced with this set: attention reads the near cache (see KVCache), which
        # is right while every position is below args.near_len (the runners' choice, runtime.choose_method).
        self.near = False

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, ctx: torch.Tensor | None = None) -> torch.Tensor:
        """Logits after ``tokens`` at positions ``input_pos[0] ..``. With ``ctx`` (any tensor whose length
        is the filled context, ``input_pos[0] + t`` or more), attention reads only the cache's first
        ``len(ctx)`` positions: exported with that length dynamic, it is a backed size, which XNNPACK
        delegates (a length read from ``input_pos`` would be unbacked, which it refuses). With ``near`` set,
        attention reads the near cache in place instead."""
        t = tokens.shape[1]
        window = NEAR if self.near else None if ctx is None else ctx.shape[0]
        pos = input_pos[0] + torch.arange(t, dtype=torch.long)
        # [t, heads, hd]: RoPE's tables for q (scaled) and k heads, 1 and 0 for v heads (left as they are)
        cos = self.cos[pos][:, None, :] * self.rope_heads + self.v_heads
        sin = self.sin[pos][:, None, :] * self.rope_heads
        # The causal mask is computed, not stored: a [max_seq, max_seq] constant would be 16 MB at 2048.
        if window is NEAR:  # its last row holds the positions past near_len: above every position read
            cols = torch.arange(self.args.near_len + 1)
        else:
            cols = torch.arange(self.args.max_seq_len if window is None else window)
        mask = torch.where(cols[None, :] <= pos[:, None], 0.0, float("-inf"))
        mask = mask.repeat(self.args.n_heads // self.args.n_kv_heads, 1)  # rows match the GQA fold
        # The near cache's rows for these positions, decided once for all layers (two portable kernels, where
        # each layer's own choice was 60 per step): a position's own row below near_len, else the row no
        # query sees.
        near_pos = torch.where(pos < self.args.near_len, pos, self.args.near_len) if self.args.near_len else None
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask, window, near_pos)
        return self.output(self.norm(x[:, -1, :]))
