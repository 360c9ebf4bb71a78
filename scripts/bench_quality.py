#!/usr/bin/env python
"""Perplexity of one model under many recipes, on the same tokens, as one markdown table.

    python scripts/bench_quality.py                                              # spinquant preset, demo model
    python scripts/bench_quality.py --learned R.bin                              # + learned-rotation columns
    python scripts/bench_quality.py --preset sweep --pte-columns none            # bit-width sweep
    python scripts/bench_quality.py --lm-eval arc_easy,hellaswag --lm-eval-limit 500

Loads the float model once and quantizes a fresh copy per cell (README's tables come from here).

``spinquant`` (default): rows W4A8 and W4A4KV4 (g32, clipping search); columns no rotation + RTN,
Hadamard (QuaRot-style) + RTN / GPTQ, learned R1/R2 (``--learned R.bin`` from ``spinquant-et
optimize``) + RTN / GPTQ. Int8 per-channel embeddings and lm_head everywhere. GPTQ calibrates on
``--calib-samples`` windows of the built-in calibration text (never the evaluation text).
``sweep``: rows W8A8 (per channel), W4A16, W4A8, W4A4KV4 (groups of 32, plain RTN) and W4A4KV4
with the clipping search; columns no rotation and random Hadamard R1-R4.
``levers``: the details that decide A4/KV4 quality, one per row against the W4A4KV4 baseline (activation
clip ratio, K/V clip ratios, o_proj's input per head, float embeddings/lm_head), Hadamard + RTN
(and learned + RTN with ``--learned``); no .pte row.

Every eager cell is also compared with FP on the same tokens (FP logits computed once): top-1
agreement (the share of positions where both pick the same next token) and mean KL(FP || cell), as
llama.cpp's ``llama-perplexity --kl-divergence`` reports them; the .pte row gets the same from
``spinquant-et eval --reference``.

``.pte`` row (printed last): the W4A8 cells of ``--pte-columns`` are also lowered to an XNNPACK
``.pte`` (8-bit dynamic activations x int4 weights, the same integers; in a child process while the
other cells run) and that program's perplexity is measured on the same windows, one token per call
through its KV cache, as a runner would use it.

``--lm-eval TASKS``: zero-shot accuracy of every eager fake-quant cell (and FP) through
lm-eval's API; needs ``pip install lm-eval`` and its datasets (from the hub or a local cache).

``--peers``: llm-compressor on the same float model and the same calibration and held-out tokens:
its SpinQuant-style rotations (R1, R2, R4; ``random-hadamard``) and its GPTQ at W4A8 g32 and W4A16
g32 (fake-quant perplexity), next to ours (Hadamard R1-R4 + GPTQ) at the same bits. llm-compressor
pins other versions of transformers than ours, so it runs in its own virtual environment under
``--peer-dir`` (created on first use: ``pip install torch==<ours> llmcompressor==LLMCOMPRESSOR``);
where it cannot be installed or run, the table says why in one line.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from spinquant_et.data import load_text, token_windows, tokenize
from spinquant_et.eval import (
    LMEvalUnavailable,
    TokenStats,
    lm_eval_scores,
    lm_eval_table,
    load_lm_eval_tasks,
    token_stats,
    window_logits,
)
from spinquant_et.models import load_model
from spinquant_et.models.load import save_hf_dir
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
    # the details that decide A4/KV4 quality, one at a time against the baseline (RTN + clip, so fast)
    "levers": [
        ("W4A4KV4 g32", dict(a_bits=4, kv_bits=4)),
        ("+ activation clip 0.9", dict(a_bits=4, kv_bits=4, a_clip=0.9)),
        ("+ K/V clip 0.95", dict(a_bits=4, kv_bits=4, k_clip=0.95, v_clip=0.95)),
        ("+ o_proj input per head", dict(a_bits=4, kv_bits=4, o_per_head=True)),
        ("+ float embeddings and lm_head", dict(a_bits=4, kv_bits=4, embedding_bits=16, lm_head_bits=16)),
        ("W4A8 g32", dict(a_bits=8)),
        ("W4A8 g32, float embeddings and lm_head", dict(a_bits=8, embedding_bits=16, lm_head_bits=16)),
    ],
}
LLMCOMPRESSOR = "0.14.0.1"  # the release measured; its own venv (its transformers pin is not ours)
PTE_ROW = "W4A8 g32"  # the recipe XNNPACK runs (8da4w); its cells can get a .pte row
DEFAULT_PTE_COLUMNS = "hadamard-gptq,learned-gptq"  # the recipes we recommend shipping


def columns(preset: str, learned: str | None) -> list[tuple[str, str, str, str]]:
    """``(header, key, rotation, w_method)`` per column; ``key`` names it in ``--pte-columns``."""
    if preset == "sweep":
        return [("no rotation", "none-rtn", "none", "rtn"), ("Hadamard R1-R4", "hadamard-rtn", "hadamard", "rtn")]
    if preset == "levers":
        cols = [("Hadamard, RTN", "hadamard-rtn", "hadamard", "rtn")]
        return cols + [("learned, RTN", "learned-rtn", learned, "rtn")] if learned else cols
    cols = [("no rotation, RTN", "none-rtn", "none", "rtn"), ("no rotation, GPTQ", "none-gptq", "none", "gptq"),
            ("Hadamard, RTN", "hadamard-rtn", "hadamard", "rtn"), ("Hadamard, GPTQ", "hadamard-gptq", "hadamard", "gptq")]
    if learned:
        cols += [("learned, RTN", "learned-rtn", learned, "rtn"), ("learned, GPTQ", "learned-gptq", learned, "gptq")]
    return cols


class BackgroundPte:
    """Lower a quantized model to a .pte and measure that program's perplexity, in a child process,
    while the eager cells go on: lowering is minutes of single-threaded Python, and the program must
    run with OMP_NUM_THREADS=1 (see spinquant_et.runtime), which would halve the eager cells here.
    The checkpoint goes to a temp dir; the child runs `spinquant-et export DIR` then `eval X.pte`
    on the same text, window length and count, so on the same tokens."""

    def __init__(self, qm, args):
        import shlex

        from spinquant_et.checkpoint import save_quantized

        self.tmp = tempfile.TemporaryDirectory(prefix="bench_quality.")
        ckpt = save_quantized(qm, Path(self.tmp.name) / "ckpt")
        pte = Path(self.tmp.name) / "model.pte"
        cli = [sys.executable, "-m", "spinquant_et.cli"]
        export = [*cli, "export", "--model", str(ckpt), "--max-seq-len", str(args.seq_len), "--out", str(pte)]
        evaluate = [*cli, "eval", "--model", str(pte), "--seq-len", str(args.seq_len), "--windows", str(args.windows),
                    "--reference", args.model, "--json"] + (["--text-file", args.text_file] if args.text_file else [])
        self.proc = subprocess.Popen(["bash", "-c", f"{shlex.join(export)} > /dev/null && {shlex.join(evaluate)}"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self) -> dict:
        """``eval --json``'s result: perplexity, and KL / top-1 agreement against the float model."""
        try:
            out, err = self.proc.communicate()
            if self.proc.returncode != 0:
                raise SystemExit(f"error: the .pte export or its evaluation failed:\n{err[-2000:]}")
            return json.loads(out.strip().splitlines()[-1])
        finally:
            self.tmp.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="alias, HF directory, hub id or .gguf (default: demo model)")
    p.add_argument("--preset", choices=list(PRESETS), default="spinquant")
    p.add_argument("--learned", help="spinquant preset: an R.bin from `spinquant-et optimize` for the learned columns")
    p.add_argument("--text-file", default=None, help="evaluation text (default: built-in held-out text)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--calib-samples", type=int, default=16,
                   help="GPTQ calibration windows of --seq-len tokens (default 16; the CLI's default is 64)")
    p.add_argument("--pte-columns", default=DEFAULT_PTE_COLUMNS,
                   help=f"columns whose {PTE_ROW} cell also gets a .pte perplexity: comma-separated keys (none-rtn, "
                        "hadamard-rtn, hadamard-gptq, learned-rtn, learned-gptq), 'all' or 'none' (default: %(default)s; "
                        "each costs an export and a token-by-token pass)")
    p.add_argument("--lm-eval", metavar="TASKS", help="comma-separated lm-eval tasks, zero-shot, on every eager cell")
    p.add_argument("--lm-eval-limit", type=int, default=None, help="examples per task (default: all)")
    p.add_argument("--lm-eval-include", metavar="DIR", help="a folder of extra lm-eval task YAMLs (local datasets)")
    p.add_argument("--json-out", help="also write the numbers as JSON (input of `spinquant-et report --quality`)")
    p.add_argument("--peers", action="store_true", help="also llm-compressor's rotations + GPTQ (W4A8, W4A16 g32) in "
                   "its own venv, next to ours at the same bits")
    p.add_argument("--peer-dir", default="bench_peers", help="where the peers' venvs live (default bench_peers)")
    p.add_argument("--peers-only", action="store_true", help="FP and the peer table only (implies --peers)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    log = logging.getLogger("bench")
    t_start = time.perf_counter()

    cols = columns(args.preset, args.learned)
    headers = [c[0] for c in cols]
    pte_cols = pte_columns(args.pte_columns, cols) if args.preset != "levers" else []
    lm_eval_tasks = None
    if args.lm_eval:  # before minutes of quantization: the tasks' datasets must be reachable
        try:
            lm_eval_tasks = load_lm_eval_tasks(args.lm_eval.split(","), args.lm_eval_include)
        except LMEvalUnavailable as e:
            print(f"note: no lm-eval columns: {e}", file=sys.stderr)

    base = load_model(args.model)
    windows = token_windows(tokenize(base.tokenizer, load_text(args.text_file, "test")), args.seq_len, args.windows)
    print(f"model {args.model}; {windows.shape[0]} windows x {args.seq_len} tokens of held-out text; int8 per-channel "
          f"embeddings and lm_head in every quantized row; GPTQ: {args.calib_samples} x {args.seq_len} calibration "
          "tokens\n", flush=True)
    with torch.no_grad():  # the float model's logits, once: every cell's KL and top-1 agreement are against them
        fp_logits = [window_logits(base.model, w[None])[0] for w in windows]
    fp_stats = TokenStats()
    for logits, window in zip(fp_logits, windows, strict=True):
        fp_stats.add(logits, window[1:])
    fp = fp_stats.perplexity
    results = {"title": f"{args.model}: perplexity, {windows.shape[0]} x {args.seq_len} held-out tokens", "fp": fp,
               "rows": [n for n, _ in PRESETS[args.preset]], "columns": headers, "ppl": {}, "pte": {}, "lm_eval": {},
               "top1": {}, "kl": {}}
    if args.learned:
        spent = learned_optimize_seconds(args.learned)
        results["learned_optimize_s"] = spent
        print(f"learned rotation {args.learned}: optimize took " + (f"{spent / 60:.1f} min" if spent else "an unknown time "
              "(no R.bin.loss.json beside it)"), flush=True)
    print("| recipe | " + " | ".join(headers) + " |\n|---|" + "---|" * len(cols))
    print("| FP (fp32) | " + " | ".join(f"{fp:.2f}" for _ in cols) + " |", flush=True)
    if lm_eval_tasks:
        results["lm_eval"]["FP (fp32)"] = lm_eval_scores(base, lm_eval_tasks, args.lm_eval_limit)

    def cell(ppl: float | None) -> str:
        if ppl is None:
            return "-"
        return f"{ppl:.2f} ({ppl / fp:.3f}x)" if args.preset != "sweep" else f"{ppl:.2f}"

    exports: dict[str, BackgroundPte] = {}
    for name, kw in [] if args.peers_only else PRESETS[args.preset]:
        ppl_row = results["ppl"].setdefault(name, {})
        for col, _, rotation, method in cols:
            t0 = time.perf_counter()
            loaded = copy.deepcopy(base)
            qm = quantize(loaded, QuantRecipe(rotation=rotation, w_method=method, calib_samples=args.calib_samples,
                                              calib_seq_len=args.seq_len, **kw), progress=False)
            stats = token_stats(qm.loaded.model, windows, progress=False, reference_logits=fp_logits).summary()
            ppl_row[col] = stats["perplexity"]
            results["top1"].setdefault(name, {})[col] = stats["top1_agreement"]
            results["kl"].setdefault(name, {})[col] = stats["mean_kl"]
            log.warning("%s / %s: %.2f, top-1 agreement %.1f%%, KL %.4f (%.0fs)", name, col, ppl_row[col],
                        100 * stats["top1_agreement"], stats["mean_kl"], time.perf_counter() - t0)
            if lm_eval_tasks:
                results["lm_eval"][f"{name} / {col}"] = lm_eval_scores(qm.loaded, lm_eval_tasks, args.lm_eval_limit)
            if name == PTE_ROW and col in pte_cols:
                exports[col] = BackgroundPte(qm, args)
            del loaded, qm
        print(f"| {name} | " + " | ".join(cell(ppl_row[c]) for c in headers) + " |", flush=True)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=2))

    if exports:  # after the eager rows, so the exports overlapped them
        for col, job in exports.items():
            t0 = time.perf_counter()
            pte = job.result()
            results["pte"][col] = pte["perplexity"]
            results["top1"].setdefault(f"{PTE_ROW}, .pte", {})[col] = pte["top1_agreement"]
            results["kl"].setdefault(f"{PTE_ROW}, .pte", {})[col] = pte["mean_kl"]
            log.warning(".pte %s / %s: %.2f (%.0fs after the eager cells)", PTE_ROW, col, results["pte"][col],
                        time.perf_counter() - t0)
        print(f"| {PTE_ROW}, `.pte` (XNNPACK 8da4w) | " + " | ".join(cell(results["pte"].get(c)) for c in headers)
              + " |", flush=True)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=2))

    print("\ntop-1 agreement with FP (the share of positions where both pick the same next token) / mean KL(FP || "
          "quantized), nats per token:\n")
    print("| recipe | " + " | ".join(headers) + " |\n|---|" + "---|" * len(cols))
    for name in results["top1"]:
        row = [f"{100 * results['top1'][name][c]:.1f}% / {results['kl'][name][c]:.3f}" if c in results["top1"][name]
               else "-" for c in headers]
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))

    if args.peers or args.peers_only:
        peer_table(base, windows, args, fp, results)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(results, indent=2))

    if lm_eval_tasks:
        limit = f", at most {args.lm_eval_limit} examples per task" if args.lm_eval_limit else ""
        print(f"\nzero-shot accuracy (lm-eval{limit}):\n\n" + lm_eval_table(results["lm_eval"]))
    print(f"\nwhole run {(time.perf_counter() - t_start) / 60:.1f} min", flush=True)


def peer_venv(root: Path) -> Path:
    """llm-compressor's own venv (created once): CPU torch of our version first, so pip keeps it."""
    venv = root / "llmcompressor"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} (llmcompressor=={LLMCOMPRESSOR}; minutes)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
        subprocess.run([*pip, f"llmcompressor=={LLMCOMPRESSOR}"], check=True)
    return python


def peer_table(base, windows, args, fp: float, results: dict) -> None:
    """llm-compressor (rotations + GPTQ) against ours (Hadamard + GPTQ), W4A8 and W4A16 g32, same tokens."""
    log = logging.getLogger("bench")
    from spinquant_et.data import calibration_windows

    calib = calibration_windows(base.tokenizer, None, args.seq_len, args.calib_samples, QuantRecipe().seed)
    peer, reason = {}, None
    try:
        python = peer_venv(Path(args.peer_dir))
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_dir(base, Path(tmp) / "fp")
            (Path(tmp) / "tokens.json").write_text(json.dumps({"calib": calib.tolist(), "eval": windows.tolist()}))
            r = subprocess.run([str(python), str(Path(__file__).parent / "peers" / "llmcompressor_quality.py"),
                                "--model", str(Path(tmp) / "fp"), "--tokens", str(Path(tmp) / "tokens.json")],
                               capture_output=True, text=True)
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                peer[row["scheme"]] = row
                log.warning("llm-compressor: %s", line)
        if r.returncode != 0:
            reason = (r.stderr.strip().splitlines() or ["no output"])[-1]
    except (subprocess.CalledProcessError, OSError) as e:
        reason = f"could not install llmcompressor=={LLMCOMPRESSOR} in its own venv: {e}"
    ours = {}
    for a_bits in (8, 16):
        t0 = time.perf_counter()
        qm = quantize(copy.deepcopy(base), QuantRecipe(rotation="hadamard", w_method="gptq", a_bits=a_bits,
                                                       calib_samples=args.calib_samples, calib_seq_len=args.seq_len),
                      progress=False)
        ours[a_bits] = (token_stats(qm.loaded.model, windows, progress=False).perplexity, time.perf_counter() - t0)
        log.warning("ours, W4A%d g32: %.2f (%.0fs)", a_bits, *ours[a_bits])
        del qm
    results["peers"] = {"llm-compressor": peer, "ours": {f"W4A{b} g32": v[0] for b, v in ours.items()},
                        "reason": reason}

    def cell(row: dict | None, key: str = "perplexity") -> str:
        return "-" if row is None else f"{row[key]:.2f} ({row[key] / fp:.3f}x)"

    version = peer.get("FP", {}).get("version", LLMCOMPRESSOR)
    print(f"\nllm-compressor {version} next to ours, same float model and tokens ({args.calib_samples} x {args.seq_len} "
          f"calibration, {windows.shape[0]} x {args.seq_len} held-out; int4 symmetric groups of 32, per-token "
          "asymmetric int8 activations):\n")
    print("| W4 g32, rotations + GPTQ | ours: Hadamard R1-R4, GPTQ aimed at the float model | llm-compressor: "
          "SpinQuantModifier R1 R2 R4 (random-hadamard) + GPTQModifier |\n|---|---|---|")
    print(f"| FP (each one's own forward) | {fp:.2f} | " + (f"{peer['FP']['perplexity']:.2f}" if "FP" in peer else "-")
          + " |")
    for a_bits in (16, 8):
        name = f"W4A{a_bits} g32"
        ppl, secs = ours[a_bits]
        theirs = peer.get(name)
        print(f"| {name} | {ppl:.2f} ({ppl / fp:.3f}x), {secs:.0f} s | "
              + ("-" if theirs is None else f"{cell(theirs)}, {theirs['oneshot_s']:.0f} s, peak RSS "
                                             f"{theirs['peak_rss_mib']:.0f} MiB") + " |")
    if reason:
        print(f"\nllm-compressor: {reason}")


def learned_optimize_seconds(r_bin: str) -> float | None:
    """What ``optimize`` spent on ``r_bin``, from the ``R.bin.loss.json`` it writes beside it."""
    log_file = Path(r_bin).with_name(Path(r_bin).name + ".loss.json")
    try:
        return float(json.loads(log_file.read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pte_columns(spec: str, cols: list[tuple[str, str, str, str]]) -> list[str]:
    """Headers of the columns whose W4A8 cell gets a .pte row: ``all``, ``none`` or keys. An unknown key
    is an error, except the default's learned one when there is no ``--learned``."""
    if spec in ("all", "none"):
        return [c[0] for c in cols] if spec == "all" else []
    wanted = [k.strip() for k in spec.split(",") if k.strip()]
    keys = [c[1] for c in cols]
    unknown = [k for k in wanted if k not in keys and not (spec == DEFAULT_PTE_COLUMNS and k.startswith("learned"))]
    if unknown:
        raise SystemExit(f"error: --pte-columns: no column {unknown[0]!r} here; choose from {', '.join(keys)}, all or none")
    return [c[0] for c in cols if c[1] in wanted]


if __name__ == "__main__":
    main()
