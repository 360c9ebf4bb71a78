#!/usr/bin/env python
"""Perplexity of one model under many recipes, on the same tokens, as one markdown table.

    python scripts/bench_quality.py --model smollm2-135m --windows 32                      # sweep
    python scripts/bench_quality.py --preset spinquant --learned R.bin --windows 32        # methods

Loads the float model once and quantizes a fresh copy per cell (README's tables come from here).

``sweep``: rows W8A8 (per channel), W4A16, W4A8, W4A4KV4 (groups of 32, plain RTN) and W4A4KV4 with
the clipping search; columns no rotation and random Hadamard R1-R4.
``spinquant``: rows W4A8 and W4A4KV4 (g32, clipping search); columns no rotation + RTN, Hadamard
(QuaRot-style) + RTN / GPTQ, learned R1/R2 (``--learned R.bin`` from ``spinquant-et optimize``)
+ RTN / GPTQ. Int8 per-channel embeddings and lm_head everywhere.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path

from spinquant_et.data import load_text, token_windows, tokenize
from spinquant_et.eval import perplexity
from spinquant_et.models import load_model
from spinquant_et.quantize import quantize
from spinquant_et.recipe import QuantRecipe

PRESETS = {
    "sweep": [
        ("W8A8 (per-channel)", dict(w_bits=8, group_size=-1, a_bits=8, w_clip=False)),
        ("W4A16 g32", dict(w_bits=4, a_bits=16, w_clip=False)),
        ("W4A8 g32", dict(w_bits=4, a_bits=8, w_clip=False)),
        ("W4A4KV4 g32", dict(w_bits=4, a_bits=4, kv_bits=4, w_clip=False)),
        ("W4A4KV4 g32 + clip", dict(w_bits=4, a_bits=4, kv_bits=4, w_clip=True)),
    ],
    "spinquant": [
        ("W4A8 g32", dict(w_bits=4, a_bits=8)),
        ("W4A4KV4 g32", dict(w_bits=4, a_bits=4, kv_bits=4)),
    ],
}


def columns(preset: str, learned: str | None) -> list[tuple[str, str, str]]:
    """``(header, rotation, w_method)`` per column."""
    if preset == "sweep":
        return [("no rotation", "none", "rtn"), ("Hadamard R1-R4", "hadamard", "rtn")]
    cols = [("no rotation, RTN", "none", "rtn"), ("Hadamard, RTN", "hadamard", "rtn"),
            ("Hadamard, GPTQ", "hadamard", "gptq")]
    if learned:
        cols += [("learned, RTN", learned, "rtn"), ("learned, GPTQ", learned, "gptq")]
    return cols


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--preset", choices=list(PRESETS), default="sweep")
    p.add_argument("--learned", help="spinquant preset: an R.bin from `spinquant-et optimize` for the learned columns")
    p.add_argument("--text-file", default=None, help="default: built-in held-out text")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--json-out", help="also write the numbers as JSON (input of `spinquant-et report --quality`)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    log = logging.getLogger("bench")

    base = load_model(args.model)
    windows = token_windows(tokenize(base.tokenizer, load_text(args.text_file, "test")), args.seq_len, args.windows)
    print(f"model {args.model}; {windows.shape[0]} windows x {args.seq_len} tokens of held-out text; "
          "int8 per-channel embeddings and lm_head in every quantized row\n")
    fp = perplexity(base.model, windows, progress=False)
    cols = columns(args.preset, args.learned)
    print("| recipe | " + " | ".join(h for h, _, _ in cols) + " |")
    print("|---|" + "---|" * len(cols))
    print("| FP (fp32) | " + " | ".join(f"{fp:.2f}" for _ in cols) + " |", flush=True)
    results = {"title": f"{args.model}: perplexity, {windows.shape[0]} x {args.seq_len} held-out tokens", "fp": fp,
               "rows": [n for n, _ in PRESETS[args.preset]], "columns": [h for h, _, _ in cols], "ppl": {}}
    for name, kw in PRESETS[args.preset]:
        cells = []
        results["ppl"][name] = {}
        for header, rotation, method in cols:
            t0 = time.perf_counter()
            loaded = copy.deepcopy(base)
            qm = quantize(loaded, QuantRecipe(rotation=rotation, w_method=method, **kw), progress=False)
            ppl = perplexity(qm.loaded.model, windows, progress=False)
            results["ppl"][name][header] = ppl
            cells.append(f"{ppl:.2f} ({ppl / fp:.2f}x)" if args.preset == "spinquant" else f"{ppl:.2f}")
            log.warning("%s / %s: %s (%.0fs)", name, header, cells[-1], time.perf_counter() - t0)
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
