"""Build the exportable ``Transformer`` from a quantized checkpoint's tensors, config and recipe."""

from __future__ import annotations

import torch

from ..errors import SpinQuantError
from ..hadamard import HadamardTransform, hadamard_factors
from ..models.arch import ArchSpec
from ..recipe import NO_QUANT, QuantRecipe
from ..rotation.apply import head_dim_of
from .model import (
    Attention,
    Block,
    ExportArgs,
    FeedForward,
    HeadNorm,
    Int8DynActInt8WeightLinear,
    Int8Embedding,
    RMSNorm,
    Transformer,
    TransposedInputKronHadamard,
    make_linear,
)


def check_exportable(recipe: QuantRecipe) -> None:
    """ExecuTorch/XNNPACK kernels exist for 8da4w linears (lm_head too) and int8 lm_head/embeddings; say so otherwise."""
    problems = []
    if recipe.w_bits not in (4, NO_QUANT):
        problems.append(f"--w-bits {recipe.w_bits} (XNNPACK runs 4-bit groupwise weights, or 16 for float)")
    if recipe.w_bits == 4 and (recipe.group_size == -1 or recipe.group_size % 32):
        problems.append(f"--group-size {recipe.group_size} (8da4w needs a multiple of 32, e.g. 32 or 256)")
    if recipe.w_bits == 4 and recipe.a_bits != 8:
        problems.append(f"--a-bits {recipe.a_bits} with 4-bit weights (8da4w means 8-bit dynamic activations)")
    if recipe.w_bits == NO_QUANT and recipe.a_bits != NO_QUANT:
        problems.append(f"--a-bits {recipe.a_bits} with float weights (use --a-bits 16)")
    if recipe.kv_bits not in (8, NO_QUANT):
        problems.append(f"--kv-bits {recipe.kv_bits} (the exported KV cache is int8 or float: use 8 or 16)")
    if recipe.a_clip != 1.0 or recipe.o_per_head or recipe.a_clip_search or recipe.a_clips or recipe.a_sym:
        problems.append("--a-clip/--a-clip-search/--a-sym/--o-per-head (XNNPACK quantizes activations per token, "
                        "asymmetric, over their full range)")
    if recipe.k_clip != 1.0 or recipe.v_clip != 1.0:
        problems.append("--k-clip/--v-clip (the exported KV cache quantizes each token over its full range)")
    if recipe.embedding_bits not in (8, NO_QUANT):
        problems.append(f"--embedding-bits {recipe.embedding_bits} (use 8 or 16)")
    if recipe.lm_head_bits not in (4, 8, NO_QUANT):
        problems.append(f"--lm-head-bits {recipe.lm_head_bits} (use 4, 8 or 16)")
    if recipe.lm_head_bits == 4 and (recipe.group_size == -1 or recipe.group_size % 32):
        problems.append(f"--lm-head-bits 4 with --group-size {recipe.group_size} (8da4w needs a multiple of 32)")
    if problems:
        raise SpinQuantError("not exportable to ExecuTorch: " + "; ".join(problems))


def _need(tensors: dict, key: str) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise SpinQuantError(f"checkpoint is missing tensor {key}; re-run quantize") from None


def rope_tables(config, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[max_seq, head_dim]`` exactly as the HF model computes them (incl. llama3 scaling)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(config)
    pos = torch.arange(max_seq_len)[None]
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0].float(), sin[0].float()


OPS = ("portable", "et-llama")
# The KV cache of a chat-sized context; forward_ctx makes prefill and decode cost what the filled
# context costs, so a longer cache costs memory, not speed (see export.lower).
DEFAULT_MAX_SEQ_LEN = 2048
# forward_near's cache: short contexts attend in place. The copy it saves grows with the context, while
# reading near_len + 1 positions costs the same at any context. 255 positions and the row for later ones
# make 256 rows: XNNPACK's attention over 256 rows measured 9-10% faster than over 257 (30 layers of
# SmolLM2's attention lowered alone, interleaved: 1.07 against 1.18 ms; 264 and 272 rows ran as 257).
NEAR_LEN = 255


def check_ops(ops: str, recipe: QuantRecipe) -> None:
    if ops not in OPS:
        raise SpinQuantError(f"--ops must be one of {', '.join(OPS)}, got {ops!r}")
    if ops == "et-llama":
        if recipe.kv_bits != NO_QUANT:
            raise SpinQuantError("--ops et-llama keeps a float KV cache; use --kv-bits 16, or --ops portable for int8")
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers llama::* for export)


def build_transformer(tensors: dict[str, torch.Tensor], config, arch: ArchSpec, recipe: QuantRecipe,
                      max_seq_len: int | None, ops: str = "portable", near_len: int = 0) -> Transformer:
    """The exportable model; quantized tensors are used as stored (``<name>.weight`` int8 + ``.scales``).
    ``max_seq_len`` None: ``DEFAULT_MAX_SEQ_LEN``, or the model's own limit where that is shorter.
    ``near_len``: the near cache's length (``KVCache``; portable ops only), at most half the cache."""
    check_exportable(recipe)
    check_ops(ops, recipe)
    limit = getattr(config, "max_position_embeddings", None)
    if max_seq_len is None:
        max_seq_len = min(DEFAULT_MAX_SEQ_LEN, limit or DEFAULT_MAX_SEQ_LEN)
    if limit and max_seq_len > limit:
        raise SpinQuantError(f"--max-seq-len {max_seq_len} is beyond the model's limit of {limit}; use at most {limit}")
    args = ExportArgs(
        vocab_size=config.vocab_size, dim=config.hidden_size, hidden_dim=config.intermediate_size,
        n_layers=config.num_hidden_layers, n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads, head_dim=head_dim_of(config), norm_eps=config.rms_norm_eps,
        max_seq_len=max_seq_len, w_bits=recipe.w_bits, group_size=recipe.group_size, a_bits=recipe.a_bits,
        kv_bits=recipe.kv_bits, lm_head_bits=recipe.lm_head_bits, embedding_bits=recipe.embedding_bits,
        rotated=recipe.rotated, qkv_bias=arch.qkv_bias, qk_norm=arch.qk_norm, ops=ops,
        near_len=min(near_len, max_seq_len // 2) if ops == "portable" else 0,
    )

    # R4 with two Kronecker factors runs with one transpose if gate/up output rows are permuted
    # offline (rows, not columns: every group keeps its integers and its scale).
    r4_factors = hadamard_factors(args.hidden_dim) if args.rotated else ()
    r4_perm = TransposedInputKronHadamard.input_permutation(*r4_factors) if len(r4_factors) == 2 else None

    def make_r4():
        if not args.rotated:
            return None
        return TransposedInputKronHadamard(r4_factors) if r4_perm is not None else HadamardTransform(args.hidden_dim).float()

    def linear(*names: str, perm: torch.Tensor | None = None):
        """One linear for ``names`` stacked on the output axis (rows keep their integers and scales);
        ``perm`` reorders the rows of each part."""
        def rows(t):
            return t if (t is None or perm is None) else t[perm]

        weights = [rows(_need(tensors, f"{n}.weight")) for n in names]
        scales = [rows(tensors.get(f"{n}.scales")) for n in names]
        biases = [rows(tensors.get(f"{n}.bias")) for n in names]
        if len({None if s is None else s.shape[1] for s in scales}) != 1:
            raise SpinQuantError(f"{', '.join(names)} are quantized differently; re-run quantize")
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(w.shape[0]) for b, w in zip(biases, weights, strict=True)])
        return make_linear(torch.cat(weights), None if scales[0] is None else torch.cat(scales), bias)

    def norm(name: str, dim: int) -> RMSNorm:
        return RMSNorm(dim, args.norm_eps).requires_grad_(False).load_weight(_need(tensors, f"{name}.weight"))

    layers = []
    for i in range(args.n_layers):
        p = f"{arch.layers}.{i}"
        attn_mod = arch.q.rpartition(".")[0]
        head_norm = None
        if arch.qk_norm:
            head_norm = HeadNorm(norm(f"{p}.{attn_mod}.q_norm", args.head_dim), norm(f"{p}.{attn_mod}.k_norm", args.head_dim),
                                 args.n_heads, args.n_kv_heads)
        attention = Attention(args, linear(f"{p}.{arch.q}", f"{p}.{arch.k}", f"{p}.{arch.v}"), linear(f"{p}.{arch.o}"),
                              head_norm)
        ffn = FeedForward(args, linear(f"{p}.{arch.gate}", f"{p}.{arch.up}", perm=r4_perm), linear(f"{p}.{arch.down}"),
                          make_r4())
        block = Block(args, attention, ffn)
        block.attention_norm = norm(f"{p}.{arch.attn_norm}", args.dim)
        block.ffn_norm = norm(f"{p}.{arch.mlp_norm}", args.dim)
        layers.append(block)

    emb_w = _need(tensors, f"{arch.embed}.weight")
    emb_s = tensors.get(f"{arch.embed}.scales")
    if emb_s is None:
        embedding = torch.nn.Embedding.from_pretrained(emb_w.float())
    else:
        embedding = Int8Embedding(emb_w, emb_s)
    head_w = _need(tensors, f"{arch.lm_head}.weight")
    head_s = tensors.get(f"{arch.lm_head}.scales")
    if head_s is not None and head_s.shape[-1] == 1:  # int8 per row
        output = Int8DynActInt8WeightLinear(head_w, head_s)
    else:  # float, or int4 groupwise (--lm-head-bits 4): 8da4w like the decoder linears
        output = make_linear(head_w, head_s, None)
    cos, sin = rope_tables(config, max_seq_len)
    model = Transformer(args, embedding, layers, output, cos, sin)
    model.norm = norm(arch.final_norm, args.dim)
    return model.eval()
