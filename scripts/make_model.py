"""Write a random-weight HF model directory with the shape of a deployment-size model.

    python scripts/make_model.py --like llama-3.2-1b --out models/llama-3.2-1b [--dtype bf16] [--layers 2]

No trained 1B+ weights are reachable offline, so this builds the published configuration with
transformers' own initialisation and the demo model's tokenizer (its ids fit every vocabulary
here; bos/eos are set to the tokenizer's). Random weights are right for memory, time, speed and
faithfulness checks (``.pte`` against eager, rotation invariance); their perplexity means nothing.

Memory stays at about one shard: the model is built on the meta device and each module is
materialised, initialised, written into the current shard and released in turn, so an 8B model
(32 GB in fp32) is written on a 24 GB machine. Shards are written to temporary names and renamed
with the index last, so an interrupted run never leaves a directory that loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# The published config.json fields of each model (checked against copies of them; see README's
# scale section for which fields could and could not be checked).
LLAMA3_ROPE_1B = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
LLAMA3_ROPE_8B = {**LLAMA3_ROPE_1B, "factor": 8.0}
SHAPES: dict[str, dict] = {
    "smollm2-360m": dict(model_type="llama", hidden_size=960, num_hidden_layers=32, num_attention_heads=15,
                         num_key_value_heads=5, head_dim=64, intermediate_size=2560, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, initializer_range=0.02),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_1B,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, initializer_range=0.02),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, initializer_range=0.02),
    "smollm2-1.7b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, head_dim=64, intermediate_size=8192, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=130000.0, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, initializer_range=0.02),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                         tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_8B,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, initializer_range=0.02),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_config(like: str, layers: int | None = None, tokenizer=None):
    """The HF config of ``like``; ``layers`` cuts the depth (tests use 2-layer cuts of full widths)."""
    from transformers import AutoConfig

    fields = dict(SHAPES[like])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if tokenizer is not None:
        fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return AutoConfig.for_model(**fields)


def _materialise(model, module: torch.nn.Module, dtype: torch.dtype, seed: int, index: int) -> None:
    """Give ``module``'s own tensors storage and transformers' initial values (seeded per module, so a
    shard's content does not depend on what was written before it)."""
    module.to_empty(device="cpu", recurse=False)
    torch.manual_seed(seed * 1_000_003 + index)
    model._init_weights(module)
    for name, p in module.named_parameters(recurse=False):
        setattr(module, name, torch.nn.Parameter(p.detach().to(dtype), requires_grad=False))


def write_model(like: str, out: Path, dtype: torch.dtype = torch.float32, layers: int | None = None,
                tokenizer_spec: str = "smollm2-135m", seed: int = 0, shard_bytes: int = 2 << 30,
                progress: bool = True, tokenizer=None) -> Path:
    """Write ``like`` (random weights) to ``out`` as sharded safetensors + config + tokenizer
    (``tokenizer``, or the one of model spec ``tokenizer_spec``)."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from spinquant_et.models.load import _load_tokenizer, _resolve
    from spinquant_et.shards import ShardWriter

    if tokenizer is None:
        source = _resolve(tokenizer_spec)
        tokenizer = _load_tokenizer(source.where, **source.kwargs)
    config = make_config(like, layers, tokenizer)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # as every published config.json (llama.cpp's converter picks its model class by this field)
    config.architectures = [type(model).__name__]
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(config.tie_word_embeddings)
    modules = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    prefixes = {id(m): n for n, m in model.named_modules()}
    with ShardWriter(out, shard_bytes) as writer:  # temporary shard names; renamed with the index last
        for i, module in enumerate(tqdm(modules, desc=f"writing {like}", unit="module", disable=not progress)):
            if tied and module is model.get_output_embeddings():
                continue
            _materialise(model, module, dtype, seed, i)
            for local, p in module.named_parameters(recurse=False):
                writer.add(f"{prefixes[id(module)]}.{local}", p)
            module.to("meta")  # release: peak memory is one shard plus one module
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--like", required=True, choices=sorted(SHAPES), help="whose published shape to build")
    p.add_argument("--out", required=True, type=Path, help="directory to write (created)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype on disk")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    p.add_argument("--tokenizer", default="smollm2-135m", help="model spec whose tokenizer is copied")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=float, default=2.0, help="safetensors shard size")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if (args.out / "config.json").exists():
        print(f"error: {args.out} already holds a model; choose another --out", file=sys.stderr)
        return 2
    write_model(args.like, args.out, DTYPES[args.dtype], args.layers, args.tokenizer, args.seed,
                int(args.shard_gb * (1 << 30)))
    print(f"wrote {args.out} ({args.like}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
