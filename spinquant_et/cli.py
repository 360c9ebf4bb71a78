"""Command-line front end. Thin: parse flags, call the stage functions, print results."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from .errors import SpinQuantError
from .recipe import NO_QUANT, QuantRecipe

log = logging.getLogger("spinquant_et")

MODEL_HELP = (
    "an HF model directory, a .gguf file, a quantized checkpoint directory (from `quantize`), "
    "a hub id (needs network) or the built-in alias smollm2-135m"
)


def _bits(text: str) -> int:
    value = int(text)
    if not (2 <= value <= 8 or value == NO_QUANT):
        raise argparse.ArgumentTypeError(f"bits must be 2..8, or 16 for float (got {value})")
    return value


def _add_text_flags(p: argparse.ArgumentParser, default_windows: int) -> None:
    p.add_argument("--text-file", help="UTF-8 text to evaluate on; default: the built-in offline text "
                   "(held-out part of CPython's documentation); 'wikitext2' uses datasets (needs network)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--windows", type=int, default=default_windows,
                   help=f"number of non-overlapping windows (default {default_windows})")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default 1)")


def _add_recipe_flags(p: argparse.ArgumentParser) -> None:
    d = QuantRecipe()
    p.add_argument("--rotation", default=d.rotation,
                   help="none | hadamard (random Hadamard R1/R2 + online R3/R4) | path to a SpinQuant R.bin "
                   f"(default {d.rotation})")
    p.add_argument("--w-bits", type=_bits, default=d.w_bits, help=f"weight bits, 16 = float (default {d.w_bits})")
    p.add_argument("--group-size", type=int, default=d.group_size,
                   help=f"input channels per weight scale, -1 = per output channel (default {d.group_size})")
    p.add_argument("--no-clip", dest="w_clip", action="store_false",
                   help="plain max-abs RTN scales instead of the per-group MSE clipping search")
    p.add_argument("--a-bits", type=_bits, default=d.a_bits,
                   help=f"per-token dynamic activation bits on every linear input but lm_head (default {d.a_bits})")
    p.add_argument("--kv-bits", type=_bits, default=d.kv_bits,
                   help=f"KV cache bits, per token and head; 16 = float (default {d.kv_bits})")
    p.add_argument("--embedding-bits", type=_bits, default=d.embedding_bits, help="embedding bits, per row (default 8)")
    p.add_argument("--lm-head-bits", type=_bits, default=d.lm_head_bits, help="lm_head bits, per row (default 8)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random Hadamard signs (default 0)")


def _recipe(args) -> QuantRecipe:
    return QuantRecipe(
        rotation=args.rotation, w_bits=args.w_bits, group_size=args.group_size, w_clip=args.w_clip,
        a_bits=args.a_bits, kv_bits=args.kv_bits, embedding_bits=args.embedding_bits,
        lm_head_bits=args.lm_head_bits, seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spinquant-et",
        description="Rotate (SpinQuant/QuaRot), quantize and evaluate Llama-family models for ExecuTorch.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="fuse norms, rotate, quantize weights; write a checkpoint directory",
                       description="Fuse RMSNorms, rotate (R1/R2 offline, R3/R4 online), quantize weights with "
                       "RTN + clipping, and write a quantized checkpoint directory (safetensors with integer "
                       "weights and scales, recipe.json, tokenizer).")
    q.add_argument("--model", required=True, help=MODEL_HELP)
    _add_recipe_flags(q)
    q.add_argument("--out", required=True, help="output directory (written atomically)")
    q.add_argument("--force", action="store_true", help="overwrite --out if it exists")

    e = sub.add_parser("eval", help="perplexity of a float model or a quantized checkpoint",
                       description="Perplexity on non-overlapping windows. A quantized checkpoint runs with its "
                       "recipe's activation/KV bits unless --a-bits/--kv-bits override them; a float model "
                       "runs in float unless they are given.")
    e.add_argument("--model", required=True, help=MODEL_HELP)
    _add_text_flags(e, default_windows=32)
    e.add_argument("--a-bits", type=_bits, help="override activation bits (fake-quant)")
    e.add_argument("--kv-bits", type=_bits, help="override KV cache bits (fake-quant)")
    e.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def cmd_quantize(args) -> int:
    from .checkpoint import save_quantized
    from .io import refuse_existing
    from .models import load_model
    from .quantize import quantize

    from pathlib import Path

    recipe = _recipe(args)
    refuse_existing(Path(args.out), args.force)  # before minutes of work, not after
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    qm = quantize(loaded, recipe)
    out = save_quantized(qm, args.out, force=args.force)
    print(f"wrote {out} ({recipe.label()}) in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_eval(args) -> int:
    from .data import load_text, token_windows, tokenize
    from .eval import perplexity
    from .models import load_model
    from .online import attach_online

    loaded = load_model(args.model)
    recipe = loaded.recipe
    a_bits = args.a_bits if args.a_bits is not None else (recipe.a_bits if recipe else NO_QUANT)
    kv_bits = args.kv_bits if args.kv_bits is not None else (recipe.kv_bits if recipe else NO_QUANT)
    attach_online(loaded.model, loaded.arch, bool(recipe and recipe.rotated), a_bits, kv_bits)
    windows = token_windows(tokenize(loaded.tokenizer, load_text(args.text_file, "test")), args.seq_len, args.windows)
    t0 = time.perf_counter()
    ppl = perplexity(loaded.model, windows, args.batch_size)
    result = {
        "model": args.model,
        "perplexity": ppl,
        "windows": int(windows.shape[0]),
        "seq_len": args.seq_len,
        "tokens": int(windows.numel()),
        "a_bits": a_bits,
        "kv_bits": kv_bits,
        "recipe": json.loads(recipe.to_json()) if recipe else None,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        label = recipe.label() if recipe else f"float (A{a_bits} KV{kv_bits})"
        print(f"| model | recipe | windows x seq | perplexity |\n|---|---|---|---|\n"
              f"| {args.model} | {label} | {result['windows']} x {args.seq_len} | {ppl:.3f} |")
    return 0


COMMANDS = {"quantize": cmd_quantize, "eval": cmd_eval}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("transformers", "torchao", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        return COMMANDS[args.command](args)
    except SpinQuantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; no output was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
