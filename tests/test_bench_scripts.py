"""The bench scripts run end to end on tiny models, print the tables README shows, and their
numbers mean something: the .pte row tracks its eager cell, every row's peak RSS is its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"


def _run(args: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _cells(stdout: str, row: str) -> list[str]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith(f"| {row} |"))
    return [c.strip() for c in line.strip("|").split("|")][1:]


def test_bench_quality_prints_eager_and_pte_rows(trained_tiny_dir, tmp_path):
    """Spinquant preset on a trained tiny Llama; the W4A8 Hadamard-GPTQ cell also as a lowered .pte,
    whose token-by-token perplexity must match the eager fake-quant one (same integers; the program
    also quantizes lm_head's input to int8 and sums in another order: a few tenths of a percent on
    SmolLM2, 3% allowed here on 94 tokens)."""
    r = _run([str(SCRIPTS / "bench_quality.py"), "--model", str(trained_tiny_dir), "--windows", "2", "--seq-len", "48",
              "--calib-samples", "4", "--pte-columns", "hadamard-gptq", "--json-out", "q.json"], tmp_path)
    header = _cells(r.stdout, "recipe")
    assert header == ["no rotation, RTN", "no rotation, GPTQ", "Hadamard, RTN", "Hadamard, GPTQ"]
    fp = float(_cells(r.stdout, "FP (fp32)")[0])
    eager = [float(c.split()[0]) for c in _cells(r.stdout, "W4A8 g32")]
    pte = _cells(r.stdout, "W4A8 g32, `.pte` (XNNPACK 8da4w)")
    assert pte[:3] == ["-", "-", "-"]
    pte_gptq = float(pte[3].split()[0])
    assert all(e > fp * 0.99 for e in eager)
    assert abs(pte_gptq / eager[3] - 1) < 0.03, (pte_gptq, eager[3])
    assert len(_cells(r.stdout, "W4A4KV4 g32")) == 4
    # top-1 agreement with FP and KL, per eager cell and for the .pte: "NN.N% / 0.ddd"
    agreement = r.stdout.split("top-1 agreement with FP")[1]
    for row in ("W4A8 g32", "W4A4KV4 g32", "W4A8 g32, .pte"):
        cells = _cells(agreement, row)
        top1 = [float(c.split("%")[0]) for c in cells if c != "-"]
        assert top1 and all(0 < t <= 100 for t in top1), cells
    assert (tmp_path / "q.json").is_file() and re.search(r"whole run [\d.]+ min", r.stdout)


def test_bench_quality_levers_preset_has_a_row_per_lever(trained_tiny_dir, tmp_path):
    r = _run([str(SCRIPTS / "bench_quality.py"), "--model", str(trained_tiny_dir), "--windows", "2", "--seq-len", "48",
              "--preset", "levers"], tmp_path)
    assert _cells(r.stdout, "recipe") == ["Hadamard, RTN"]
    baseline = float(_cells(r.stdout, "W4A4KV4 g32")[0].split()[0])
    clipped = float(_cells(r.stdout, "+ activation clip 0.9")[0].split()[0])
    assert clipped != baseline  # the lever reaches the model
    for row in ("+ K/V clip 0.95", "+ o_proj input per head", "+ float embeddings and lm_head", "W4A8 g32"):
        assert float(_cells(r.stdout, row)[0].split()[0]) > 1


def test_bench_quality_rejects_an_unknown_pte_column(trained_tiny_dir, tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_quality.py"), "--model", str(trained_tiny_dir),
                        "--pte-columns", "gptq"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "--pte-columns: no column 'gptq'" in r.stderr


def test_bench_speed_rows_carry_their_own_peak_rss(tiny_hf_dir, tmp_path):
    """.pte variants, each benched in its own process: the table has them, with ratios to 8da4w (1.000 for
    the baseline itself) and a peak RSS per row, and int8 against float step by step as well."""
    r = _run([str(SCRIPTS / "bench_speed.py"), "--model", str(tiny_hf_dir["llama"]), "--out-dir", "b", "--only",
              "8da4w + R1-R4", "8da4w + R1-R4, int8 KV cache", "--max-seq-len", "64", "--prompt-tokens", "16",
              "--new-tokens", "8", "--repeats", "1", "--no-llama-cpp"], tmp_path)
    assert "llama.cpp row skipped" in r.stdout
    base, rotated = _cells(r.stdout, "8da4w"), _cells(r.stdout, "8da4w + R1-R4")
    forward_only = _cells(r.stdout, "8da4w + R1-R4, forward only (stock runners)")  # the same file, decoding as stock runners do
    cols = _cells(r.stdout, "runtime, file")
    assert base[cols.index("decode vs 8da4w")] == "1.000"
    assert forward_only[cols.index("size MiB")] == rotated[cols.index("size MiB")]
    for row in (base, rotated, forward_only):
        assert float(row[cols.index("decode tok/s")]) > 0 and float(row[cols.index("peak RSS MiB")]) > 50
    assert sorted(p.name for p in (tmp_path / "b").glob("*.pte")) == ["8da4w-64.pte", "8da4w_R1_R4-64.pte",
                                                                     "8da4w_R1_R4_int8_KV_cache-64.pte"]
    # int8 against float, also step by step in one process, each load order: 2 x 7 pairs of steps (8 new
    # tokens, the first from the prompt)
    paired = re.search(r"step-paired in one process: ([\d.]+)x \(quartiles ([\d.]+)-([\d.]+) over (\d+) pairs", r.stdout)
    assert paired and int(paired[4]) == 14 and float(paired[2]) <= float(paired[1]) <= float(paired[3])


def test_bench_stage_memory_reports_each_stage_of_an_export(tiny_hf_dir, tmp_path):
    """Every stage the export path goes through gets a peak (the wrapped entry points still exist and are
    still called), and the command's own output is unchanged: the .pte is written."""
    r = _run([str(SCRIPTS / "bench_stage_memory.py"), "--log", "stages.log", "export", "--model",
              str(tiny_hf_dir["llama"]), "--w-method", "rtn", "--max-seq-len", "32", "--out", "m.pte"], tmp_path)
    peaks = dict((stage.strip(), float(mib)) for mib, stage in re.findall(r"^ +(\d+)  (.+)$", r.stdout, re.M))
    for stage in ("build", "lower: export forward_ctx", "lower: partition forward_near", "XNNPACK preprocess",
                  "emit", "write"):
        assert peaks.get(stage, 0) > 50, (stage, r.stdout)
    assert (tmp_path / "m.pte").stat().st_size > 0
    assert "XNNPACK preprocess #1" in (tmp_path / "stages.log").read_text()


@pytest.mark.parametrize("missing", ["lm_eval"])
def test_lm_eval_without_the_package_says_how_to_get_it(missing, monkeypatch):
    """With lm-eval absent (simulated by hiding the module), the bench gets a one-line reason, not a traceback."""
    from spinquant_et.eval import LMEvalUnavailable, load_lm_eval_tasks

    monkeypatch.setitem(sys.modules, missing, None)  # `import lm_eval` now raises ImportError
    monkeypatch.setitem(sys.modules, f"{missing}.tasks", None)
    with pytest.raises(LMEvalUnavailable, match="pip install lm-eval"):
        load_lm_eval_tasks(["arc_easy"])


def _local_task(folder: Path, n: int = 24) -> str:
    """An lm-eval multiple-choice task over a local JSON file: which of two continuations of a sentence
    from the built-in text is the real one (the other is the same words reversed)."""
    import json

    from spinquant_et.data import builtin_text

    words = builtin_text("train")[:200_000].split()
    docs = []
    for i in range(n):
        start = 997 * i % (len(words) - 40)
        context, real = " ".join(words[start:start + 16]), words[start + 16:start + 24]
        docs.append({"context": context, "choices": [" " + " ".join(real), " " + " ".join(real[::-1])], "label": 0})
    (folder / "docs.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (folder / "local_order.yaml").write_text(
        "task: local_order\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'docs.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n")
    return "local_order"


def test_lm_eval_scores_a_fake_quant_model_on_a_local_task(trained_tiny_dir, tmp_path, monkeypatch):
    """lm-eval's real harness, offline: a task over a local JSON file, scored on the float model and a
    W4A8 Hadamard fake-quant copy. The trained tiny model has learned word order, so it must beat chance."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from spinquant_et.eval import lm_eval_scores, lm_eval_table, load_lm_eval_tasks
    from spinquant_et.models import load_model
    from spinquant_et.quantize import quantize
    from spinquant_et.recipe import QuantRecipe

    task = _local_task(tmp_path)
    tasks = load_lm_eval_tasks([task], str(tmp_path))
    fp = lm_eval_scores(load_model(str(trained_tiny_dir)), tasks)
    quantized = quantize(load_model(str(trained_tiny_dir)), QuantRecipe(a_bits=8), progress=False)
    q = lm_eval_scores(quantized.loaded, tasks)
    assert fp[task]["acc"] > 0.6 and 0 <= q[task]["acc"] <= 1, (fp, q)
    table = lm_eval_table({"FP": fp, "W4A8": q})
    assert table.splitlines()[0] == f"| model | {task} acc |" and table.count("\n") == 3


def test_profile_pte_accounts_for_the_decode_time(tiny_pte, tmp_path):
    """The per-operator table of a tiny .pte: its quantized linears are there with one call per
    linear and token (2 layers x q/k/v stacked, o, gate+up stacked, down), and the rows add up to no more
    than the whole method's time."""
    # forward_near's decode steps, forward_ctx's, or forward's
    for flags in ([], ["--methods", "forward,forward_ctx"], ["--forward-only"]):
        r = _run([str(SCRIPTS / "profile_pte.py"), str(tiny_pte), "--prompt-tokens", "8", "--steps", "4", *flags],
                 tmp_path)
        rows = {}
        for line in r.stdout.splitlines()[3:]:
            name, calls, ms, _ = (c.strip() for c in line.strip("|").split("|"))
            rows[name] = (float(calls), float(ms))
        total = rows.pop("**Method::execute**")
        assert rows["Fully Connected (NC, QDU8, F32, QB4W) GEMM"][0] == 8
        assert "native_call_index_put_" in rows
        assert 0 < sum(ms for _, ms in rows.values()) <= total[1] * 1.01


def test_profile_pte_refuses_more_steps_than_the_cache_holds(tiny_pte, tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPTS / "profile_pte.py"), str(tiny_pte), "--steps", "500"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "max_seq_len 96" in r.stderr


def test_profile_pte_refuses_methods_the_runtime_cannot_run_alone(tiny_pte, tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPTS / "profile_pte.py"), str(tiny_pte), "--methods", "forward_near"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2 and "--methods must include forward" in r.stderr


def test_llama_cpp_reads_every_tensor_of_a_tied_gguf_per_token():
    """The memory-ceiling column: llama.cpp's tied output is its embedding table, so a decode step reads
    every tensor of the demo GGUF (no output.weight), nearly the whole file (the rest is metadata and
    vocabulary); our .pte rows leave the int8 embedding table (vocab x hidden bytes) out."""
    sys.path.insert(0, str(SCRIPTS))
    from bench_speed import embedding_bytes_of_pte, embedding_entries, gguf_read_bytes

    from spinquant_et.models.load import alias_path

    gguf = alias_path("smollm2-135m")
    read = gguf_read_bytes(str(gguf))
    assert 0.9 * gguf.stat().st_size < read < gguf.stat().st_size
    entries = embedding_entries("smollm2-135m")
    assert entries == 49152 * 576
    assert embedding_bytes_of_pte(entries, "8da4w + R1-R4") == entries
    assert embedding_bytes_of_pte(entries, "fp32") == 4 * entries
