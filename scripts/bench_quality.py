#!/usr/bin/env python
"""Perplexity of one model under many recipes, on the same tokens, as one markdown table.

    python scripts/bench_quality.py --model smollm2-135m --windows 32

Loads the float model once and quantizes a fresh copy per row (the table in README comes from
this script). Rows: FP; W8A8 (per-channel weights), W4A16, W4A8, W4A4KV4 (groups of 32, plain RTN)
each without rotation and with random Hadamard R1-R4; W4A4KV4 with the clipping search.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

from spinquant_et.data import load_text, token_windows, tokenize
from spinquant_et.eval import perplexity
from spinquant_et.models import load_model
from spinquant_et.quantize import quantize
from spinquant_et.recipe import QuantRecipe

ROWS = [
    # (name, recipe kwargs)
    ("W8A8 (per-channel)", dict(w_bits=8, group_size=-1, a_bits=8, w_clip=False)),
    ("W4A16 g32", dict(w_bits=4, a_bits=16, w_clip=False)),
    ("W4A8 g32", dict(w_bits=4, a_bits=8, w_clip=False)),
    ("W4A4KV4 g32", dict(w_bits=4, a_bits=4, kv_bits=4, w_clip=False)),
    ("W4A4KV4 g32 + clip", dict(w_bits=4, a_bits=4, kv_bits=4, w_clip=True)),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text-file", default=None, help="default: built-in held-out text")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--rotations", default="none,hadamard")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    base = load_model(args.model)
    windows = token_windows(tokenize(base.tokenizer, load_text(args.text_file, "test")), args.seq_len, args.windows)
    print(f"model {args.model}; {windows.shape[0]} windows x {args.seq_len} tokens of held-out text; "
          "int8 per-channel embeddings and lm_head in every quantized row\n")
    fp = perplexity(base.model, windows, progress=False)
    rotations = args.rotations.split(",")
    print("| recipe | " + " | ".join(f"{r} rotation" for r in rotations) + " |")
    print("|---|" + "---|" * len(rotations))
    print("| FP (fp32) | " + " | ".join(f"{fp:.2f}" for _ in rotations) + " |", flush=True)
    for name, kw in ROWS:
        cells = []
        for rotation in rotations:
            t0 = time.perf_counter()
            loaded = copy.deepcopy(base)
            qm = quantize(loaded, QuantRecipe(rotation=rotation, **kw), progress=False)
            cells.append(f"{perplexity(qm.loaded.model, windows, progress=False):.2f}")
            logging.getLogger("bench").warning("%s %s: %s (%.0fs)", name, rotation, cells[-1], time.perf_counter() - t0)
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
