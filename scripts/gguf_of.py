#!/usr/bin/env python
"""Write a llama.cpp GGUF of an HF model directory (the same weights our exports start from), for the
speed comparison against llama.cpp:

    python scripts/gguf_of.py --model models/llama-3.2-1b --out models/llama-3.2-1b/model.Q4_0.gguf [--type q4_0]

llama.cpp's own converter does the work: ``convert_hf_to_gguf.py`` ships in the llama-cpp-python source
distribution (the version installed here, fetched once from the package registry by ``pip download``
into ``--tools-dir``), then ``llama_cpp.llama_model_quantize`` (the installed llama-cpp-python)
quantizes its f16 output. Q4_0 is llama.cpp's plain 4-bit format: groups of 32 with one fp16 scale,
the closest to our int4 g32 weights. The f16 intermediate is written beside ``--out`` and removed;
the result is written to a temporary name and renamed, so an interrupted run leaves no GGUF.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

TYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "f16": None}


def converter(tools_dir: Path) -> Path:
    """``vendor/llama.cpp`` of the installed llama-cpp-python's source distribution (its converter, the
    ``conversion`` package it imports and its own ``gguf-py``), unpacked once under ``tools_dir``."""
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("error: llama-cpp-python is not installed; `pip install llama-cpp-python` (it quantizes "
                         "the GGUF and runs it)") from None
    root = tools_dir / f"llama.cpp-{version}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    tools_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tools_dir) as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={version}", "-d", tmp], capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if r.returncode != 0 or not sdists:
            raise SystemExit(f"error: could not download llama-cpp-python {version}'s source distribution "
                             f"(it holds llama.cpp's converter):\n{r.stderr[-1500:]}")
        prefix = f"{sdists[0].name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(wanted) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):]
            staged = Path(tmp) / "llama.cpp"
            tar.extractall(staged, members=members, filter="data")
        staged.replace(root)
    return root


_UNKNOWN_PRE = "unrecognized BPE pre-tokenizer: wrote 'default'"
# llama.cpp's converter, run with one change: a BPE pre-tokenizer it does not recognize (which it refuses)
# becomes 'default'. A random-weight Qwen2 shape with the demo's tokenizer gets there: transformers loads
# that tokenizer as Qwen2's class, whose pre-tokenizer hashes to nothing llama.cpp lists.
_CONVERT = f"""
import runpy, sys
from conversion.base import TextModel
recognized = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return recognized(self, tokenizer)
    except NotImplementedError:
        print("{_UNKNOWN_PRE}")
        return "default"
TextModel.get_vocab_base_pre = pre
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(model: Path, out: Path, ftype: str, tools_dir: Path) -> Path:
    """``model`` (an HF directory) -> ``out`` (a GGUF of ``ftype``)."""
    import llama_cpp

    root = converter(tools_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.stem}.") as tmp:
        f16 = Path(tmp) / "model.f16.gguf"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "gguf-py"), str(root)])}
        r = subprocess.run([sys.executable, "-c", _CONVERT, str(root / "convert_hf_to_gguf.py"), str(model), "--outtype",
                            "f16", "--outfile", str(f16)], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(f"error: llama.cpp's converter failed on {model}:\n{r.stderr[-2000:]}")
        if _UNKNOWN_PRE in r.stdout:
            print(f"note: llama.cpp does not know {model}'s BPE pre-tokenizer; the GGUF says 'default': right for "
                  "speed (bench_speed gives llama.cpp token ids), not for its own tokenization of text", file=sys.stderr)
        result = f16
        if TYPES[ftype]:
            result = Path(tmp) / "model.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, TYPES[ftype])
            params.nthread = os.cpu_count() or 1
            if llama_cpp.llama_model_quantize(str(f16).encode(), str(result).encode(), params) != 0:
                raise SystemExit(f"error: llama.cpp could not quantize {f16} to {ftype}")
        result.replace(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (safetensors, config, tokenizer)")
    p.add_argument("--out", required=True, help="the GGUF to write")
    p.add_argument("--type", choices=list(TYPES), default="q4_0", help="llama.cpp weight type (default q4_0)")
    p.add_argument("--tools-dir", default="bench_peers", help="where llama.cpp's converter is unpacked (default "
                   "bench_peers, shared with bench_speed's peers)")
    args = p.parse_args()
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise SystemExit(f"error: {model} is not an HF model directory (no config.json)")
    out = convert(model, Path(args.out), args.type, Path(args.tools_dir))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
