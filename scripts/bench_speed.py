#!/usr/bin/env python
"""Speed and size of .pte variants of one model, side by side, in one run (2 threads, CPU).

    python scripts/bench_speed.py --model smollm2-135m --out-dir bench_out [--reuse]

Variants: fp32 (no quantization), 8da4w without rotation, 8da4w with Hadamard R1-R4 (our default;
also through the C++ runner when runner/build/spinquant-run exists), and the same with ``--ops
et-llama`` (ExecuTorch's custom cache/SDPA ops). Python rows use our runtime. Each row: export
seconds, file size, prefill and decode tokens/s (median of --repeats), and the ratio of each to
the 8da4w no-rotation baseline, so the online Hadamards' cost reads directly.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: see spinquant_et.runtime

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from spinquant_et.data import builtin_text, tokenize  # noqa: E402
from spinquant_et.export.pipeline import export  # noqa: E402
from spinquant_et.recipe import QuantRecipe  # noqa: E402
from spinquant_et.runtime import PteModel, generate  # noqa: E402

VARIANTS = {  # name: (recipe, --ops)
    "fp32": (QuantRecipe(rotation="none", w_bits=16, a_bits=16, embedding_bits=16, lm_head_bits=16), "portable"),
    "8da4w": (QuantRecipe(rotation="none"), "portable"),
    "8da4w + R1-R4": (QuantRecipe(rotation="hadamard"), "portable"),
    "8da4w + R1-R4, et-llama ops": (QuantRecipe(rotation="hadamard"), "et-llama"),
}
BASELINE = "8da4w"
CPP_RUNNER = Path(__file__).parents[1] / "runner" / "build" / "spinquant-run"
CPP_OF = "8da4w + R1-R4"  # the variant also run through the C++ runner (portable ops only)


def bench_cpp(pte: Path, prompt: str, new_tokens: int, repeats: int) -> dict:
    """Median ttft/prefill/decode of ``spinquant-run`` (2 threads) on ``pte``, and its peak RSS."""
    import re
    import subprocess

    runs = []
    for _ in range(repeats + 1):  # the first is a warm-up
        r = subprocess.run([str(CPP_RUNNER), "--model", str(pte), "--prompt", prompt, "--max-new-tokens",
                            str(new_tokens), "--ignore-eos", "--threads", "2"], capture_output=True, text=True, check=True)
        m = re.search(r"ttft ([\d.]+) ms; prefill \d+ tok at ([\d.]+) tok/s; decode \d+ tok at ([\d.]+) tok/s; "
                      r"peak RSS ([\d.]+) MiB", r.stderr)
        runs.append(tuple(float(x) for x in m.groups()))
    runs = runs[1:]
    return dict(ttft_ms=statistics.median(r[0] for r in runs), prefill=statistics.median(r[1] for r in runs),
                decode=statistics.median(r[2] for r in runs), rss_mib=max(r[3] for r in runs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reuse", action="store_true", help="bench existing .pte files instead of re-exporting")
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), help="bench these variants (default: all)")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    rows = {}
    for name, (recipe, ops) in VARIANTS.items():
        if args.only and name not in args.only and name != BASELINE:
            continue
        pte = out_dir / (name.replace(" ", "").replace("+", "_").replace(",", "_") + f"-{args.max_seq_len}.pte")
        export_s = float("nan")
        if not (args.reuse and pte.exists()):
            t0 = time.perf_counter()
            export(args.model, recipe, pte, args.max_seq_len, force=True, ops=ops)
            export_s = time.perf_counter() - t0
        model = PteModel(pte)
        from transformers import AutoTokenizer

        ids = tokenize(AutoTokenizer.from_pretrained(out_dir), builtin_text("test"))[: args.prompt_tokens].tolist()
        generate(model, ids[:8], 4, stop_at_eos=False)  # warm-up
        stats = [generate(model, ids, args.new_tokens, stop_at_eos=False)[1] for _ in range(args.repeats)]
        rows[name] = dict(
            export_s=export_s, size_mib=pte.stat().st_size / 2**20,
            prefill=statistics.median(s.prefill_tok_s for s in stats),
            decode=statistics.median(s.decode_tok_s for s in stats),
            ttft_ms=statistics.median(s.ttft_s * 1000 for s in stats),
        )
        print(f"{name}: {rows[name]}", flush=True)
        if name == CPP_OF and CPP_RUNNER.is_file():
            tok = AutoTokenizer.from_pretrained(out_dir)
            rows[name + ", C++ runner"] = dict(export_s=float("nan"), size_mib=rows[name]["size_mib"],
                                                **bench_cpp(pte, tok.decode(ids), args.new_tokens, args.repeats))
            print(f"{name}, C++ runner: {rows[name + ', C++ runner']}", flush=True)

    base = rows[BASELINE]
    print(f"\n{args.model}, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, max_seq_len "
          f"{args.max_seq_len}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, median of {args.repeats}\n")
    print("| .pte | export s | size MiB | prefill tok/s | decode tok/s | ttft ms | peak RSS MiB | decode vs 8da4w "
          "| prefill vs 8da4w | size vs 8da4w |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        rss = f"{r['rss_mib']:.0f}" if "rss_mib" in r else "-"
        export_s = "-" if r["export_s"] != r["export_s"] else f"{r['export_s']:.0f}"
        print(f"| {name} | {export_s} | {r['size_mib']:.1f} | {r['prefill']:.0f} | {r['decode']:.1f} | "
              f"{r['ttft_ms']:.0f} | {rss} | {r['decode'] / base['decode']:.3f} | {r['prefill'] / base['prefill']:.3f} "
              f"| {r['size_mib'] / base['size_mib']:.2f} |")


if __name__ == "__main__":
    main()
