"""What a user sees: stage progress for every part of export, no library noise unless -v, and the
files export writes, with the usual permissions."""

import os
import stat
import subprocess
import sys

NOISE = ("Warning", "W1203", "INFO root", "cpuinfo", "Traceback")


def cli(*args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "spinquant_et.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=cwd)


def test_export_shows_every_stage_and_no_library_noise_unless_verbose(tiny_hf_dir, tmp_path):
    flags = ["--model", tiny_hf_dir["llama"], "--w-method", "rtn", "--max-seq-len", "32", "--forward-only"]
    quiet = cli("export", *flags, "--out", tmp_path / "a" / "m.pte")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    for stage in ("quantize weights", "export forward", "decompose forward", "partition forward",
                  "XNNPACK preprocess", "emit and write"):
        assert stage in quiet.stderr, stage
    assert not [n for n in NOISE if n in quiet.stderr], quiet.stderr[-3000:]

    verbose = cli("export", *flags, "--out", tmp_path / "b" / "m.pte", "-v")
    assert verbose.returncode == 0 and "Warning" in verbose.stderr  # the same libraries, heard

    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["m.pte", "m.recipe.json", "tokenizer.json", "tokenizer_config.json"], files
    gen = cli("generate", tmp_path / "a" / "m.pte", "--prompt", "hello", "--max-new-tokens", "4")
    assert gen.returncode == 0 and gen.stderr.strip().startswith("ttft"), gen.stderr  # one line: its timings


def test_outputs_have_the_usual_mode(tiny_hf_dir, tmp_path):
    """safetensors and temp files are written 0600; a finished output reads like any other file."""
    from spinquant_et.cli import main

    old = os.umask(0o022)
    try:
        assert main(["quantize", "--model", str(tiny_hf_dir["llama"]), "--w-method", "rtn", "--out",
                     str(tmp_path / "q")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "q").iterdir()}
    assert set(modes.values()) == {0o644}, modes
