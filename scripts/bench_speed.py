#!/usr/bin/env python
"""Speed, memory and size of .pte variants of one model, and llama.cpp on its GGUF, in one run (2 threads, CPU).

    python scripts/bench_speed.py --model smollm2-135m --out-dir bench_out [--reuse]

Rows: fp32 (no quantization), 8da4w without rotation, 8da4w with Hadamard R1-R4 (our default;
also through the C++ runner when runner/build/spinquant-run exists, and through ``forward`` as
ExecuTorch's stock runners run it instead of ``forward_near``/``forward_ctx``: same file), the same with an int8 KV
cache (R3 in the graph), the same with a 256-position cache (does speed follow the filled context or
the capacity?), the same with ``--ops et-llama`` (ExecuTorch's custom cache/SDPA ops), and llama.cpp
when ``llama-cpp-python`` is installed: on the model's GGUF as shipped (the demo model is one), or
for an HF directory on a Q4_0 GGUF of the same weights that llama.cpp's own converter writes
(scripts/gguf_of.py). A row whose cache cannot hold the prompt and the new tokens is left out. Every row is
measured in its own process, so its peak RSS is its own: Python rows are ``spinquant-et bench``
(our runtime; RSS includes Python and torch), the C++ row is ``spinquant-run``, the llama.cpp row
is llama-cpp-python with ``n_threads=2``. All rows get the same prompt token ids and decode greedily
without stopping at EOS. Each figure is also printed as a ratio to the 8da4w row, and decode
against llama.cpp's when it ran. The ratios between two of our programs (the long cache against
the 256-position one, the int8 KV cache against float) are also measured step by step in one
process, each step of one program next to the same step of the other, since rows measured minutes
apart carry the machine's drift; once in each load order (the program loaded second ran 3-5% faster).
Our runners start themselves with malloc on huge pages (``spinquant_et.hugepages``), so their rows and
the step-paired children run that way; llama.cpp runs as it comes (it maps its GGUF file, whose pages
get no THP: it decoded the same with the tunable set).

``--peers`` adds the tools a user would otherwise pick, exported in this run and run by the same
runtime: ExecuTorch's own ``export_llama`` (from the wheel) on our ``convert``ed checkpoint, and
optimum-executorch's ``optimum-cli export executorch`` in its own venv. Every exported row also
shows its export's wall time and peak RSS (``os.wait4``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from spinquant_et.hugepages import huge_page_tunables

THREADS = 2
VARIANTS = {  # name: `spinquant-et export` flags
    "fp32": ["--rotation", "none", "--w-bits", "16", "--a-bits", "16", "--embedding-bits", "16", "--lm-head-bits", "16"],
    "8da4w": ["--rotation", "none"],
    "8da4w + R1-R4": ["--rotation", "hadamard"],
    "8da4w + R1-R4, int8 KV cache": ["--rotation", "hadamard", "--kv-bits", "8"],
    "8da4w + R1-R4, 256-position cache": ["--rotation", "hadamard", "--max-seq-len", "256"],  # overrides --max-seq-len
    "8da4w + R1-R4, int4 lm_head": ["--rotation", "hadamard", "--lm-head-bits", "4"],
    "8da4w + R1-R4, et-llama ops": ["--rotation", "hadamard", "--ops", "et-llama"],
}
BASELINE = "8da4w"
CPP_RUNNER = Path(__file__).parents[1] / "runner" / "build" / "spinquant-run"
CPP_OF = "8da4w + R1-R4"  # the variant also run through the C++ runner and through forward only (portable ops)
FORWARD_ONLY = f"{CPP_OF}, forward only (stock runners)"
LLAMA_CPP = "llama.cpp"  # on the GGUF as shipped, or a Q4_0 of the same weights for an HF directory
PEER_DIR = "bench_peers"
OPTIMUM_VERSION = "1.1.0"  # the release measured
EXPORT_LLAMA = "ExecuTorch export_llama from our convert (8da4w, no rotation, custom SDPA + KV cache)"
OPTIMUM = f"optimum-executorch {OPTIMUM_VERSION} (8da4w g32, custom SDPA + KV cache)"


def child_env() -> dict:
    # One thread per process for MKL/OpenMP: ExecuTorch's own 2 workers would otherwise fight them
    # (see spinquant_et.runtime); llama.cpp sets its own thread count.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def last_json(cmd: list[str], env: dict | None = None) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env or child_env())
    if r.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_python(pte: Path, prompt_tokens: int, new_tokens: int, repeats: int, forward_only: bool = False) -> dict:
    """``spinquant-et bench`` in a fresh process: medians and that process's peak RSS."""
    r = last_json([sys.executable, "-m", "spinquant_et.cli", "bench", str(pte), "--prompt-tokens", str(prompt_tokens),
                   "--max-new-tokens", str(new_tokens), "--repeats", str(repeats), "--json"]
                  + (["--forward-only"] if forward_only else []))
    return dict(prefill=r["prefill_tok_s"]["median"], decode=r["decode_tok_s"]["median"],
                ttft_ms=r["ttft_ms"]["median"], rss_mib=r["peak_rss_mib"])


def bench_cpp(pte: Path, prompt: str, new_tokens: int, repeats: int) -> dict:
    """Median ttft/prefill/decode of ``spinquant-run --threads 2 --warmup`` on ``pte``, and its peak RSS.
    ``--warmup`` runs the prompt and one step before the timed run, as the Python rows and llama.cpp's
    warm up in their process (a program's first calls allocate and plan: cold, the prefill measured
    0.8x). ``prompt`` is the prompt ids decoded; the runner's tokenizer gives HF's ids back (tests check it)."""
    runs = []
    for _ in range(repeats + 1):  # the first process warms the page cache
        r = subprocess.run([str(CPP_RUNNER), "--model", str(pte), "--prompt", prompt, "--max-new-tokens",
                            str(new_tokens), "--ignore-eos", "--warmup", "--threads", str(THREADS)],
                           capture_output=True, text=True, check=True, env=child_env())
        m = re.search(r"ttft ([\d.]+) ms; prefill \d+ tok at ([\d.]+) tok/s; decode \d+ tok at ([\d.]+) tok/s; "
                      r"peak RSS ([\d.]+) MiB", r.stderr)
        runs.append(tuple(float(x) for x in m.groups()))
    runs = runs[1:]
    return dict(ttft_ms=statistics.median(r[0] for r in runs), prefill=statistics.median(r[1] for r in runs),
                decode=statistics.median(r[2] for r in runs), rss_mib=max(r[3] for r in runs))


def measure_llama_cpp(gguf: str, ids: list[int], new_tokens: int, repeats: int, n_ctx: int, extra_bufts: bool) -> dict:
    """In this (child) process: llama.cpp prefill of ``ids`` and greedy decode, timed like our runtime's
    ``generate`` (ttft = prefill + first argmax; decode tok/s over the remaining tokens).

    ``extra_bufts=False`` turns off llama.cpp's extra weight buffer types (AMX, repacked layouts): on
    CPUs that advertise AMX inside VMs that do not grant it, its AMX matmul segfaults."""
    import llama_cpp
    import numpy as np

    from spinquant_et.sysinfo import peak_rss_mib

    if not extra_bufts:  # llama-cpp-python has no argument for it; its constructor reads these defaults
        import llama_cpp.llama_cpp as low_level

        defaults = low_level.llama_model_default_params

        def without_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params

        low_level.llama_model_default_params = without_extra_bufts
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=n_ctx, n_threads=THREADS, n_threads_batch=THREADS,
                verbose=False)

    def run(prompt: list[int], n: int) -> tuple[float, float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t_prefill = time.perf_counter() - t0
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return ttft, t_prefill, time.perf_counter() - t1

    run(ids[:8], 4)  # warm-up
    stats = [run(ids, new_tokens) for _ in range(repeats)]
    return dict(ttft_ms=statistics.median(s[0] * 1000 for s in stats),
                prefill=statistics.median(len(ids) / s[1] for s in stats),
                decode=statistics.median((new_tokens - 1) / s[2] for s in stats), rss_mib=peak_rss_mib(),
                version=llama_cpp.__version__, extra_bufts=extra_bufts)


def measure_paired(ptes: list[str], ids: list[int], new_tokens: int, repeats: int) -> dict:
    """In this (child) process: decode steps of two programs alternating step by step (A's step at position
    p and B's, in turns first), after a prompt each. Both programs see the same moment of a drifting machine, so the
    ratio of each pair of steps is far steadier than a ratio of rows measured minutes apart (their
    speed drifted by 20% between processes here). Median step times and the quartiles of B/A step time
    (A's speed relative to B's) come from ``bench_paired``, which runs both load orders."""
    from spinquant_et.runtime import PteModel
    from spinquant_et.sampling import SamplingConfig, sample_token

    greedy = SamplingConfig()

    models = [PteModel(p) for p in ptes]
    for m in models:  # warm-up: every method the timed run calls allocates and plans on its first call
        m.forward(ids, 0)
        m.forward([ids[-1]], len(ids))
    steps: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        tokens = [sample_token(m.forward(ids, 0), greedy, None) for m in models]  # greedy, as generate
        for pos in range(len(ids), len(ids) + new_tokens - 1):
            # ABBA: the program stepped first pays for what the other left in the caches and for threads
            # waking up (a fixed order moved the int8-KV ratio by 3%), so the order alternates per step
            for i in (0, 1) if pos % 2 == 0 else (1, 0):
                m = models[i]
                t0 = time.perf_counter()
                tokens[i] = sample_token(m.forward([tokens[i]], pos), greedy, None)
                steps[i].append(time.perf_counter() - t0)
    return dict(step_ms=[statistics.median(s) * 1e3 for s in steps], ratios=[b / a for a, b in zip(*steps, strict=True)])


def bench_paired(a: Path, b: Path, ids: list[int], args) -> dict:
    """``measure_paired`` of ``a`` against ``b``, each load order in its own child process: the program
    loaded second decoded 3-5% faster than the one loaded first, the same file against itself included,
    so one order alone biases the ratio by that much. The ratios of both orders (B's step time over A's)
    are pooled: their median and quartiles, and each order's median."""
    env = child_env()
    if tunables := huge_page_tunables(env):  # malloc on huge pages, as our runners start themselves
        env["GLIBC_TUNABLES"] = tunables

    def child(first: Path, second: Path) -> dict:
        return last_json([sys.executable, __file__, "--measure-paired", str(first), str(second), "--ids",
                          ",".join(map(str, ids)), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)],
                         env)

    ab, ba = child(a, b), child(b, a)
    by_order = [ab["ratios"], [1 / r for r in ba["ratios"]]]
    q = statistics.quantiles(by_order[0] + by_order[1], n=4)
    return dict(ratio=q[1], ratio_q1=q[0], ratio_q3=q[2], steps=len(by_order[0]) + len(by_order[1]),
                by_order=[statistics.median(r) for r in by_order],
                step_ms=[(ab["step_ms"][0] + ba["step_ms"][1]) / 2, (ab["step_ms"][1] + ba["step_ms"][0]) / 2])


def bench_llama_cpp(gguf: str, ids: list[int], args, state: dict) -> dict:
    """The llama.cpp row, in a child process; without extra buffer types from the first crash on
    (``state`` remembers it, and the version, across rounds)."""
    cmd = [sys.executable, __file__, "--measure-llama-cpp", gguf, "--ids", ",".join(map(str, ids)), "--new-tokens",
           str(args.new_tokens), "--repeats", str(args.repeats), "--max-seq-len", str(args.max_seq_len)]
    if state.get("extra_bufts") is False:
        cmd.append("--no-extra-bufts")
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if r.returncode < 0 and "--no-extra-bufts" not in cmd:  # killed by a signal: SIGSEGV/SIGILL in its AMX matmul here
        state["crash"] = signal.Signals(-r.returncode).name
        print(f"llama.cpp crashed ({state['crash']}); again without extra buffer types", file=sys.stderr)
        cmd.append("--no-extra-bufts")
        r = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if r.returncode != 0:
        raise SystemExit(f"error: the llama.cpp row failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    state["version"], state["extra_bufts"] = out.pop("version"), out.pop("extra_bufts")
    return out


def gguf_of(model: str, out_dir: Path, peer_dir: Path) -> str | None:
    """The GGUF llama.cpp runs: the model itself when it is one (the demo model's, as shipped), else for an
    HF directory a Q4_0 GGUF of the same weights, written once into ``out_dir`` by llama.cpp's own
    converter and quantizer (scripts/gguf_of.py)."""
    from spinquant_et.models.load import ALIASES, alias_path

    if model in ALIASES:
        model = str(alias_path(model))
    if model.endswith(".gguf") and Path(model).is_file():
        return model
    if not (Path(model) / "config.json").is_file():
        return None
    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_of import convert

    gguf = out_dir / "llama.cpp.Q4_0.gguf"
    if not gguf.is_file():
        print(f"writing {gguf} (llama.cpp's converter, then Q4_0)", file=sys.stderr, flush=True)
        convert(Path(model), gguf, "q4_0", peer_dir)
    return str(gguf)


def run_measured(cmd: list[str], what: str) -> tuple[float, float]:
    """Run ``cmd`` to its end: ``(wall seconds, peak RSS MiB)`` of it and the children it waited for
    (``os.wait4``'s rusage); exits with its stderr's tail when it fails."""
    import tempfile

    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"error: {what} failed:\n{err.read().decode(errors='replace')[-2000:]}")
    return time.perf_counter() - t0, usage.ru_maxrss / 1024  # Linux: KiB


def export_all(model: str, jobs: dict[str, Path], max_seq_len: int, parallel: int,
               w_method: str) -> dict[str, tuple[float, float]]:
    """``spinquant-et export`` for each ``{variant: pte}``, ``parallel`` processes at a time (lowering is
    single-threaded Python, so two exports on two cores take about the time of one).
    ``(seconds, peak RSS MiB)`` per variant."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> tuple[float, float]:
        cmd = [sys.executable, "-m", "spinquant_et.cli", "export", "--model", model, "--max-seq-len", str(max_seq_len),
               "--w-method", w_method, *VARIANTS[name], "--out", str(jobs[name]), "--force"]  # a variant's own flags win
        seconds, rss = run_measured(cmd, f"export of {name}")
        print(f"exported {name} in {seconds:.0f}s, peak RSS {rss:.0f} MiB", file=sys.stderr, flush=True)
        return seconds, rss

    with ThreadPoolExecutor(max(1, parallel)) as pool:
        return dict(zip(jobs, pool.map(one, jobs), strict=True))


def export_llama_pte(model: str, out_dir: Path, pte: Path, max_seq_len: int, w_method: str) -> tuple[float, float]:
    """ExecuTorch's own ``export_llama`` (from the wheel) on our ``convert``ed checkpoint, with the flags
    ExecuTorch recommends for XNNPACK speed (its custom SDPA and KV-cache ops): ``--rotation none``,
    since ``convert`` refuses R4 of a size that is not a power of two (SmolLM2's 1536).
    ``(seconds, peak RSS MiB)`` over quantize + convert + export_llama."""
    work = out_dir / "export_llama"
    cli = [sys.executable, "-m", "spinquant_et.cli"]
    steps = [
        (cli + ["quantize", "--model", model, "--rotation", "none", "--w-method", w_method, "--out", str(work / "q"),
                "--force"], "quantize for export_llama"),
        (cli + ["convert", str(work / "q"), "--out", str(work / "meta"), "--force"], "convert"),
        ([sys.executable, "-m", "executorch.examples.models.llama.export_llama", "--checkpoint",
          str(work / "meta" / "consolidated.00.pth"), "--params", str(work / "meta" / "params.json"),
          "--preq_mode", "8da4w_output_8da8w", "--preq_group_size", "32", "--preq_embedding_quantize", "8,0",
          "--use_qat", "--use_kv_cache", "--use_sdpa_with_kv_cache", "-X", "-d", "fp32",
          "--max_seq_length", str(max_seq_len), "--max_context_length", str(max_seq_len), "--output_name", str(pte)],
         "export_llama"),
    ]
    measured = [run_measured(cmd, what) for cmd, what in steps]
    seconds, rss = sum(m[0] for m in measured), max(m[1] for m in measured)
    print(f"exported {EXPORT_LLAMA} in {seconds:.0f}s, peak RSS {rss:.0f} MiB", file=sys.stderr, flush=True)
    return seconds, rss


def optimum_venv(root: Path) -> Path:
    """optimum-executorch's own venv, created once (it pins transformers 5.0.0rc1; ours is newer):
    our CPU torch first so pip keeps it, then the peer with our executorch and torchao."""
    import torch

    python = root / "optimum" / "bin" / "python"
    if not python.exists():
        print(f"creating {python.parents[1]} (optimum-executorch=={OPTIMUM_VERSION}; minutes)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(python.parents[1])], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
        subprocess.run([*pip, f"optimum-executorch=={OPTIMUM_VERSION}", f"torch=={torch.__version__.split('+')[0]}",
                        *(f"{m}=={importlib.metadata.version(m)}" for m in ("executorch", "torchao"))], check=True)
    return python


def optimum_pte(model: str, out_dir: Path, pte: Path, max_seq_len: int, peer_dir: Path) -> tuple[float, float]:
    """optimum-executorch's XNNPACK export of the same float model, with the flags its README gives for
    speed (custom SDPA, custom KV cache, 8da4w linears, int8 embeddings), groups of 32 as ours.
    ``(seconds, peak RSS MiB)`` of ``optimum-cli export executorch`` (the float HF directory it reads is
    written first, not timed)."""
    from spinquant_et.models import load_model
    from spinquant_et.models.load import save_hf_dir

    python = optimum_venv(peer_dir)
    hf_dir, work = out_dir / "optimum" / "fp", out_dir / "optimum" / "pte"
    if not (hf_dir / "config.json").is_file():
        save_hf_dir(load_model(model), hf_dir)
    cmd = [str(python.parent / "optimum-cli"), "export", "executorch", "--model", str(hf_dir), "--task",
           "text-generation", "--recipe", "xnnpack", "--use_custom_sdpa", "--use_custom_kv_cache", "--qlinear", "8da4w",
           "--qlinear_group_size", "32", "--qembedding", "8w", "--max_seq_len", str(max_seq_len), "--output_dir",
           str(work)]
    seconds, rss = run_measured(cmd, "optimum-cli export executorch")
    (work / "model.pte").replace(pte)
    print(f"exported {OPTIMUM} in {seconds:.0f}s, peak RSS {rss:.0f} MiB", file=sys.stderr, flush=True)
    return seconds, rss


def seq_len_of(variant: str, default: int) -> int:
    flags = VARIANTS[variant]
    return int(flags[flags.index("--max-seq-len") + 1]) if "--max-seq-len" in flags else default


# Ratios between two of our programs, also measured step by step in one process (measure_paired):
# (what, A, B) for "A's decode speed against B's"
PAIRS = [("decode, the long cache against the 256-position one", CPP_OF, f"{CPP_OF}, 256-position cache"),
         ("decode, int8 KV cache against float", f"{CPP_OF}, int8 KV cache", CPP_OF)]


def print_checks(rows: dict, paired: dict) -> None:
    """The ratios the speed issue asks for, from the table's medians (where both rows ran), and the
    step-paired ones (``paired``: what -> measure_paired's result)."""
    def line(what: str, a: str, b: str, key: str = "decode") -> None:
        if a in rows and b in rows:
            print(f"* {what}: {rows[a][key] / rows[b][key]:.3f}x ({a}: {rows[a][key]:.1f}, {b}: {rows[b][key]:.1f})")

    print()
    for what, a, b in PAIRS:
        line(what, a, b)
        if what in paired:
            r = paired[what]
            print(f"  * step-paired in one process: {r['ratio']:.3f}x (quartiles {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}"
                  f" over {r['steps']} pairs of steps, both load orders: {r['by_order'][0]:.3f}x loaded first, "
                  f"{r['by_order'][1]:.3f}x loaded second; median step {r['step_ms'][0]:.2f} against "
                  f"{r['step_ms'][1]:.2f} ms)")
    for name in (CPP_OF, f"{CPP_OF}, C++ runner"):
        line(f"decode against llama.cpp, {name}", name, LLAMA_CPP)
        line(f"prefill against llama.cpp, {name}", name, LLAMA_CPP, key="prefill")


def copy_bandwidth_gbs(threads: int = THREADS, mib: int = 512) -> float:
    """Memory bandwidth as a large copy with ``threads`` threads measures it: (bytes read + bytes written) /
    time, as STREAM's Copy counts it, best of 5. A decode step reads every weight once, so this over the
    bytes a step reads is the step rate the memory allows (the ceiling)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(mib << 18)  # float32: mib MiB
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * src.numel() * 4 / best / 1e9


def embedding_entries(model: str) -> int:
    """Entries of ``model``'s embedding table: a decode step reads one row of it (lm_head is its own tensor,
    read whole, even when tied), so the table is left out of the bytes a step reads."""
    from spinquant_et.models.load import load_config

    config = load_config(model)
    config = getattr(config, "text_config", config)
    return config.vocab_size * config.hidden_size


def embedding_bytes_of_pte(entries: int, variant: str) -> int:
    """The embedding table's bytes in a ``variant`` .pte: int8 rows, float in the fp32 variant."""
    return entries * (4 if variant == "fp32" else 1)


def gguf_read_bytes(gguf: str) -> int:
    """Bytes a llama.cpp decode step reads: every tensor but the embedding table, which counts only when
    the model has no output matrix of its own (tied: llama.cpp's lm_head is the embedding table)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors}
    total = sum(sizes.values())
    return total if "output.weight" not in sizes else total - sizes.get("token_embd.weight", 0)


def ratio(a: float | None, b: float | None, fmt: str) -> str:
    return "-" if a is None or not b else format(a / b, fmt)


def print_table(rows: dict, header: str, bandwidth_gbs: float) -> None:
    base = rows.get(BASELINE, {})
    ref = rows.get(LLAMA_CPP)
    print(f"\n{header}\n")
    cols = ["export s", "export peak RSS MiB", "size MiB", "prefill tok/s", "decode tok/s", "ttft ms", "peak RSS MiB",
            "prefill vs 8da4w",
            "decode vs 8da4w", "ttft vs 8da4w", "RSS vs 8da4w", "size vs 8da4w"] + (["decode vs llama.cpp"] if ref else [])
    cols += ["MiB read per token", "decode / memory ceiling"]
    print("| runtime, file | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, r in rows.items():
        export = r.get("export")
        cells = ["-" if export is None else f"{export[0]:.0f}", "-" if export is None else f"{export[1]:.0f}",
                 f"{r['size_mib']:.1f}",
                 f"{r['prefill']:.0f}", f"{r['decode']:.1f}", f"{r['ttft_ms']:.0f}", f"{r['rss_mib']:.0f}",
                 *(ratio(r[k], base.get(k), f) for k, f in (("prefill", ".3f"), ("decode", ".3f"), ("ttft_ms", ".3f"),
                                                             ("rss_mib", ".2f"), ("size_mib", ".2f")))]
        if ref:
            cells.append(ratio(r["decode"], ref["decode"], ".2f"))
        read = r.get("read_bytes")  # decode / (bandwidth / bytes read per token)
        cells += ["-", "-"] if read is None else [f"{read / 2**20:.1f}", f"{r['decode'] * read / (bandwidth_gbs * 1e9):.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="alias, HF directory or .gguf (default: the demo model)")
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="of every .pte but the 256-position one, and llama.cpp's context (default 2048)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="runs per process (after a warm-up; default 3)")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per row, interleaved across rows (default 3)")
    p.add_argument("--reuse", action="store_true", help="bench existing .pte files instead of re-exporting")
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), help=f"these .pte variants (and {BASELINE}; default: all)")
    p.add_argument("--no-baseline", action="store_true", help=f"leave out the {BASELINE} row that --only adds (its "
                   "ratio columns then read '-'): one export less at large shapes")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp row")
    p.add_argument("--parallel-exports", type=int, default=2, help="exports running at once (default 2)")
    p.add_argument("--w-method", choices=["rtn", "gptq"], default="rtn",
                   help="how the 4-bit weights are chosen (default rtn: speed and size do not depend on their values, "
                   "and GPTQ adds about 12 minutes per variant on 2 cores)")
    p.add_argument("--peers", action="store_true",
                   help="add rows for ExecuTorch's export_llama (on our converted checkpoint) and optimum-executorch "
                   f"{OPTIMUM_VERSION} (in its own venv under --peer-dir, created on first use)")
    p.add_argument("--peer-dir", default=PEER_DIR, help=f"where the peers' venvs and llama.cpp's converter live "
                   f"(default {PEER_DIR})")
    p.add_argument("--measure-llama-cpp", metavar="GGUF", help=argparse.SUPPRESS)  # the child process of that row
    p.add_argument("--measure-paired", nargs=2, metavar="PTE", help=argparse.SUPPRESS)  # a paired ratio's child
    p.add_argument("--ids", help=argparse.SUPPRESS)
    p.add_argument("--no-extra-bufts", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure_paired:
        ids = [int(t) for t in args.ids.split(",")]
        print(json.dumps(measure_paired(args.measure_paired, ids, args.new_tokens, args.repeats)))
        return
    if args.measure_llama_cpp:
        ids = [int(t) for t in args.ids.split(",")]
        print(json.dumps(measure_llama_cpp(args.measure_llama_cpp, ids, args.new_tokens, args.repeats, args.max_seq_len,
                                           extra_bufts=not args.no_extra_bufts)))
        return

    from spinquant_et.data import builtin_text, tokenize
    from spinquant_et.models.load import _load_tokenizer

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    names = [n for n in VARIANTS if (not args.only or n in args.only or (n == BASELINE and not args.no_baseline))
             and args.prompt_tokens + args.new_tokens <= seq_len_of(n, args.max_seq_len)]
    ptes = {n: out_dir / (re.sub(r"[^\w]+", "_", n).strip("_") + f"-{args.max_seq_len}.pte") for n in names}
    todo = {n: p for n, p in ptes.items() if not (args.reuse and p.exists())}
    exported = export_all(args.model, todo, args.max_seq_len, args.parallel_exports, args.w_method) if todo else {}
    # the prompt every row gets: the first tokens of the built-in held-out text
    tokenizer = _load_tokenizer(str(out_dir))
    ids = tokenize(tokenizer, builtin_text("test"))[: args.prompt_tokens].tolist()
    # Every row is measured once per round, rounds interleave the rows, and a row's figures are the
    # median over rounds: on a shared 2-core VM, speed drifts by tens of percent over minutes, and
    # interleaving spreads the slow spells over all rows instead of landing on one.
    # name: (size, (export s, export peak RSS) or None, one run)
    measure: dict[str, tuple[float, tuple[float, float] | None, Callable[[], dict]]] = {}
    read_bytes = {}  # row: bytes a decode step reads (every weight but the embedding table)
    entries = embedding_entries(args.model)  # reads the model's config once (a GGUF's header for the demo)
    for name, pte in ptes.items():
        size = pte.stat().st_size / 2**20
        read_bytes[name] = pte.stat().st_size - embedding_bytes_of_pte(entries, name)
        if name == CPP_OF:  # the same file through other runners
            read_bytes[FORWARD_ONLY] = read_bytes[f"{name}, C++ runner"] = read_bytes[name]
        measure[name] = (size, exported.get(name), lambda pte=pte: bench_python(pte, len(ids), args.new_tokens,
                                                                               args.repeats))
        if name == CPP_OF:
            measure[FORWARD_ONLY] = (size, None, lambda pte=pte: bench_python(pte, len(ids), args.new_tokens, args.repeats,
                                                                             forward_only=True))
        if name == CPP_OF and CPP_RUNNER.is_file():
            measure[f"{name}, C++ runner"] = (size, None, lambda pte=pte: bench_cpp(pte, tokenizer.decode(ids),
                                                                                      args.new_tokens, args.repeats))
    if args.peers:  # exported one after the other (their own times), run by our Python runtime like our rows
        for name, stem, make in (
                (EXPORT_LLAMA, "export_llama", lambda pte: export_llama_pte(args.model, out_dir, pte, args.max_seq_len,
                                                                            args.w_method)),
                (OPTIMUM, "optimum", lambda pte: optimum_pte(args.model, out_dir, pte, args.max_seq_len,
                                                             Path(args.peer_dir)))):
            pte = out_dir / f"{stem}-{args.max_seq_len}.pte"
            cost = None if args.reuse and pte.exists() else make(pte)
            measure[name] = (pte.stat().st_size / 2**20, cost,
                             lambda pte=pte: bench_python(pte, len(ids), args.new_tokens, args.repeats))
    gguf = None
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        llama_note = "llama.cpp row skipped: `pip install llama-cpp-python` to add it"
    else:
        if not args.no_llama_cpp:
            gguf = gguf_of(args.model, out_dir, Path(args.peer_dir))
        llama_note = None if gguf else f"llama.cpp row skipped: {args.model} is neither a .gguf nor an HF directory"
    if args.no_llama_cpp:
        llama_note = "llama.cpp row skipped (--no-llama-cpp)"
    llama_state: dict = {}
    if llama_note is None:
        measure[LLAMA_CPP] = (Path(gguf).stat().st_size / 2**20, None,
                              lambda: bench_llama_cpp(gguf, ids, args, llama_state))

    runs: dict[str, list[dict]] = {name: [] for name in measure}
    for round_ in range(args.rounds):
        for name, (_, _, run_once) in measure.items():
            runs[name].append(run_once())
            print(f"round {round_ + 1}/{args.rounds}, {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    rows = {name: dict(export=export, size_mib=size, **{k: statistics.median(r[k] for r in runs[name])
                                                          for k in ("prefill", "decode", "ttft_ms")},
                       rss_mib=max(r["rss_mib"] for r in runs[name]))
            for name, (size, export, _) in measure.items()}
    for name, row in rows.items():
        row["read_bytes"] = read_bytes.get(name)
    if gguf:
        rows[LLAMA_CPP]["read_bytes"] = gguf_read_bytes(gguf)
    bandwidth = copy_bandwidth_gbs()
    if llama_state:
        llama_note = (f"llama.cpp: llama-cpp-python {llama_state['version']} on {Path(gguf).name}, n_threads={THREADS}, "
                      f"n_ctx={args.max_seq_len}"
                      + ("" if llama_state["extra_bufts"] else
                         f", extra buffer types (AMX, repack) off: with them it crashed here ({llama_state['crash']})"))

    print_table(rows, bandwidth_gbs=bandwidth,
                header=f"{args.model}: {len(ids)}-token prompt, {args.new_tokens} new tokens (greedy, no EOS stop), "
                      f"max_seq_len {args.max_seq_len}, {THREADS} threads, median of {args.rounds} interleaved rounds x "
                      f"{args.repeats} runs; weights by {args.w_method}; export s is wall time "
                      f"with {args.parallel_exports} exports at once; {llama_note}; memory ceiling: copy bandwidth "
                      f"{bandwidth:.1f} GB/s ({THREADS} threads, read + write); "
                      f"whole run {(time.perf_counter() - t_start) / 60:.1f} min")
    paired = {}
    for what, a, b in PAIRS:
        if a in ptes and b in ptes:
            paired[what] = bench_paired(ptes[a], ptes[b], ids, args)
            print(f"paired, {what}: {paired[what]}", file=sys.stderr, flush=True)
    print_checks(rows, paired)


if __name__ == "__main__":
    main()
