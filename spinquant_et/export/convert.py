"""``convert``: a quantized checkpoint directory -> ExecuTorch's pre-quantized Llama checkpoint.

The output is what ExecuTorch's own ``export_llama --preq_mode 8da4w_output_8da8w
--use_spin_quant native --checkpoint consolidated.00.pth --params params.json`` reads
(``examples/models/llama/source_transformation/pre_quantization.py``):

* Meta key names (``tok_embeddings``, ``layers.N.attention.wq``, ``feed_forward.w1/w2/w3``, ...),
  the ``write_model_llama`` layout, with q/k rows (and their scales, biases, q/k norms) moved from
  HF's half-split RoPE order back to Meta's interleaved pairs;
* linears: int8 tensors holding int4 values with fp32 ``.scales [out, in/gs]`` (symmetric, so no
  zeros); ``output`` and ``tok_embeddings``: int8 with per-row fp32 ``.scales [rows]``;
* a float tensor first (the loader reads the checkpoint dtype from the first key), an explicit
  ``output.weight`` (our checkpoints are always untied), and a file name without "int8"/"8da4w"
  (the loader branches on those substrings);
* ``params.json`` holding only ``ModelArgs`` fields (``ModelArgs(**params)`` rejects others).

The integers are copied, never re-rounded, so GPTQ or clipped RTN survive the conversion.
ExecuTorch's SpinQuant path applies R4 with ``llama::fast_hadamard_transform`` (plain Sylvester
Hadamard, sizes 2^k only) and has no R3, so ``convert`` refuses what that path would run wrongly.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from ..checkpoint import read_checkpoint
from ..errors import SpinQuantError
from ..io import atomic_output_dir
from ..models.arch import ArchSpec
from ..recipe import NO_QUANT, QuantRecipe
from ..rotation.apply import head_dim_of

log = logging.getLogger(__name__)

CHECKPOINT = "consolidated.00.pth"
PARAMS = "params.json"
PREQ_GROUP_SIZES = (32, 64, 128, 256)  # what pre_quantization.transform_linear_for_pre_quantization accepts
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def check_convertible(recipe: QuantRecipe, config) -> None:
    """One-line errors for recipes ExecuTorch's pre-quantized loader cannot represent."""
    if recipe.w_bits != 4 or recipe.group_size not in PREQ_GROUP_SIZES:
        raise SpinQuantError(
            f"ExecuTorch's pre-quantized 8da4w checkpoint needs 4-bit weights with group size in "
            f"{PREQ_GROUP_SIZES}, got w-bits {recipe.w_bits} group-size {recipe.group_size}; re-run quantize"
        )
    if recipe.embedding_bits != 8 or recipe.lm_head_bits != 8:
        raise SpinQuantError("ExecuTorch's 8da4w_output_8da8w mode needs --embedding-bits 8 and --lm-head-bits 8; re-run quantize")
    if recipe.kv_bits < NO_QUANT:
        raise SpinQuantError(
            "ExecuTorch's SpinQuant path has no R3 and no quantized KV cache; convert a --kv-bits 16 checkpoint, "
            "or lower this one with `spinquant-et export`"
        )
    n = config.intermediate_size
    if recipe.rotated and n & (n - 1):
        raise SpinQuantError(
            f"intermediate size {n} is not a power of two: ExecuTorch's fast_hadamard_transform cannot apply R4 "
            "to it; use `spinquant-et export`, whose Kronecker Hadamard handles every size"
        )


def hf_to_meta_rows(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo HF's q/k row permutation (half-split RoPE -> Meta's interleaved pairs) on any ``[out, ...]``."""
    rows = t.shape[0]
    half = rows // n_heads // 2
    return t.reshape(n_heads, 2, half, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def meta_key_map(arch: ArchSpec, n_layers: int) -> dict[str, str]:
    """``{HF module path: Meta module path}`` for every module a checkpoint stores tensors of."""
    names = {arch.embed: "tok_embeddings", arch.final_norm: "norm", arch.lm_head: "output"}
    per_layer = {
        arch.q: "attention.wq", arch.k: "attention.wk", arch.v: "attention.wv", arch.o: "attention.wo",
        arch.gate: "feed_forward.w1", arch.down: "feed_forward.w2", arch.up: "feed_forward.w3",
        arch.attn_norm: "attention_norm", arch.mlp_norm: "ffn_norm",
        "self_attn.q_norm": "attention.q_norm_fn", "self_attn.k_norm": "attention.k_norm_fn",
    }
    for i in range(n_layers):
        names.update({f"{arch.layers}.{i}.{hf}": f"layers.{i}.{meta}" for hf, meta in per_layer.items()})
    return names


def to_meta(tensors: dict[str, torch.Tensor], config, arch: ArchSpec) -> dict[str, torch.Tensor]:
    """Rename to Meta keys and un-permute q/k; float tensors first, per-row scales squeezed to ``[rows]``."""
    names = meta_key_map(arch, config.num_hidden_layers)
    hd = head_dim_of(config)
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module not in names:
            raise SpinQuantError(f"checkpoint tensor {key} has no place in the Meta layout; re-run quantize")
        meta = names[module]
        if meta.endswith(("attention.wq", "attention.wk")):
            t = hf_to_meta_rows(t, t.shape[0] // hd)
        elif meta.endswith(("q_norm_fn", "k_norm_fn")):
            t = hf_to_meta_rows(t, 1)
        if leaf == "scales" and t.shape[-1] == 1:
            t = t.squeeze(-1)  # per-row scales: ExecuTorch's int8 embedding/output keep them as [rows]
        out[f"{meta}.{leaf}"] = t.contiguous()
    first = sorted(out, key=lambda k: (not out[k].is_floating_point() or k.endswith(".scales"), k))
    return {k: out[k] for k in first}


def meta_params(config, recipe: QuantRecipe) -> dict:
    """``params.json`` for ``ModelArgs(**params)``: only fields that class defines.

    ``quantization_args.group_size`` is checked by export_llama against ``--preq_group_size``.
    """
    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    params = {
        "dim": config.hidden_size,
        "n_layers": config.num_hidden_layers,
        "n_heads": config.num_attention_heads,
        "n_kv_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "hidden_dim": config.intermediate_size,
        "head_dim": head_dim_of(config),
        "norm_eps": config.rms_norm_eps,
        "rope_theta": float(theta) if theta is not None else 10000.0,
        "use_hf_rope": False,
        "attention_qkv_bias": bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2"),
        "use_qk_norm": config.model_type == "qwen3",
        "qk_norm_before_rope": config.model_type == "qwen3",
        "quantization_args": {"group_size": recipe.group_size},
    }
    rope_type = rope.get("rope_type", "default")
    if rope_type == "llama3":
        params.update(use_scaled_rope=True, rope_scale_factor=int(rope["factor"]),
                      high_freq_factor=int(rope.get("high_freq_factor", 4)))
    elif rope_type != "default":
        raise SpinQuantError(f"RoPE scaling {rope_type!r} has no ExecuTorch ModelArgs equivalent; use `spinquant-et export`")
    return params


def convert(checkpoint_dir: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write ``out/consolidated.00.pth``, ``out/params.json`` and the tokenizer files, atomically."""
    checkpoint_dir = Path(checkpoint_dir)
    tensors, config, arch, recipe = read_checkpoint(checkpoint_dir)
    check_convertible(recipe, config)
    params = meta_params(config, recipe)
    if any(s in str(Path(out).resolve()) for s in ("int8", "8da4w")):
        raise SpinQuantError(f"{out}: export_llama picks its loader by path substring and would misread a path "
                             "containing 'int8' or '8da4w'; choose another directory name")
    meta = to_meta(tensors, config, arch)
    with atomic_output_dir(out, force) as tmp:
        torch.save(meta, tmp / CHECKPOINT)
        (tmp / PARAMS).write_text(json.dumps(params, indent=2))
        (tmp / "recipe.json").write_text(recipe.to_json())
        for name in TOKENIZER_FILES:
            if (checkpoint_dir / name).exists():
                shutil.copy2(checkpoint_dir / name, tmp / name)
    log.info("wrote %s (%d tensors) and %s", CHECKPOINT, len(meta), PARAMS)
    return Path(out)
