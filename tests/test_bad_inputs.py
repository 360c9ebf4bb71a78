"""Every bad input a user can hand the CLI: one ``error:`` line that names the problem and the fix,
exit code 2, nothing left on disk, and (where the model's config suffices) no wait for its weights.

``CASES`` is the list docs/errors.md documents; a test keeps the two in step. Cases that need the
weights to be unreadable prove the check comes before loading them: they run on a copy of the tiny
model whose ``model.safetensors`` is truncated, so a check after the load would report that instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from spinquant_et.cli import main

DOC = Path(__file__).parents[1] / "docs" / "errors.md"


class Env:
    """Paths a case builds its command from (created on first use: the .pte costs a lowering)."""

    def __init__(self, tmp: Path, request):
        self.tmp, self._request = tmp, request

    def fixture(self, name):
        return self._request.getfixturevalue(name)

    @property
    def hf(self) -> Path:
        return self.fixture("tiny_hf_dir")["llama"]

    @property
    def broken_weights(self) -> Path:
        """The tiny model with truncated weights: only checks made before loading them can pass it."""
        d = self.tmp / "broken_weights"
        if not d.exists():
            shutil.copytree(self.hf, d)
            data = (d / "model.safetensors").read_bytes()
            (d / "model.safetensors").write_bytes(data[: len(data) // 3])
        return d

    def ckpt_with(self, name: str, text: str) -> Path:
        """A copy of the tiny quantized checkpoint whose ``name`` holds ``text``."""
        d = self.tmp / f"ckpt_{name.replace('.', '_')}"
        shutil.copytree(self.fixture("tiny_ckpt"), d)
        (d / name).write_text(text)
        return d

    @property
    def pte(self) -> Path:
        return self.fixture("tiny_pte")

    def file(self, name: str, content: bytes | str) -> Path:
        path = self.tmp / "inputs" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    def r_bin(self, data) -> Path:
        path = self.tmp / "inputs" / "R.bin"
        path.parent.mkdir(exist_ok=True)
        torch.save(data, path)
        return path


def _export_over_tokenizer(e: Env):
    out = e.tmp / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # what an earlier export into this folder left
    return ["export", "--model", e.fixture("tiny_ckpt"), "--out", out / "second.pte"]


# (id, command built from Env, what the one line must say)
CASES = [
    ("unsupported architecture", lambda e: ["eval", "--model", _gpt2_dir(e)],
     "unsupported architecture 'gpt2'; supported: llama, mistral, qwen2, qwen3"),
    ("model path that does not exist", lambda e: ["eval", "--model", e.tmp / "nope.gguf"], "model not found:"),
    ("a file that is neither a model directory nor a .gguf",
     lambda e: ["eval", "--model", e.file("weights.txt", "hello")], "is neither a model directory nor a .gguf file"),
    ("corrupt .gguf", lambda e: ["eval", "--model", e.file("bad.gguf", b"GGUF" + b"\x00garbage" * 10)],
     "is not a readable GGUF file"),
    ("config.json that is not JSON", lambda e: ["eval", "--model", _hf_with(e, "config.json", "{ not json")],
     "config.json is not valid JSON"),
    ("truncated model.safetensors", lambda e: ["eval", "--model", e.broken_weights],
     "the file may be corrupt or truncated: re-download it"),
    ("model directory without a tokenizer", lambda e: ["eval", "--model", _hf_without_tokenizer(e)],
     "no usable tokenizer"),
    ("group size that does not divide a layer (checked before the weights load)",
     lambda e: ["quantize", "--model", e.broken_weights, "--group-size", "100", "--out", e.tmp / "q"],
     "--group-size 100 does not divide in_features 96"),
    ("calibration text file that does not exist (checked before the weights load)",
     lambda e: ["quantize", "--model", e.broken_weights, "--calib-text", e.tmp / "missing.txt", "--out", e.tmp / "q"],
     "text file not found"),
    ("evaluation text file that does not exist (checked before the weights load)",
     lambda e: ["eval", "--model", e.broken_weights, "--text-file", e.tmp / "missing.txt"], "text file not found"),
    ("text shorter than one window",
     lambda e: ["eval", "--model", e.hf, "--text-file", e.file("short.txt", "only a few words"), "--seq-len", "512"],
     "fewer than one window of 512; use a longer text or a smaller --seq-len"),
    ("R.bin that is not a checkpoint (checked before the weights load)",
     lambda e: ["quantize", "--model", e.broken_weights, "--rotation", e.file("bad.bin", b"garbage" * 20),
                "--out", e.tmp / "q"], "as an R.bin"),
    ("R.bin for another model's width (checked before the weights load)",
     lambda e: ["quantize", "--model", e.broken_weights, "--rotation", e.r_bin({"R1": torch.eye(64)}),
                "--out", e.tmp / "q"], "R.bin: R1 has shape (64, 64), expected (96, 96)"),
    ("R.bin rotation file that does not exist",
     lambda e: ["quantize", "--model", e.hf, "--rotation", e.tmp / "none.bin", "--out", e.tmp / "q"],
     "rotation file not found"),
    ("existing output directory without --force",
     lambda e: ["quantize", "--model", e.hf, "--out", _existing_dir(e)], "already exists; pass --force"),
    ("recipe.json that is not JSON", lambda e: ["eval", "--model", e.ckpt_with("recipe.json", '{"w_bits": 4,')],
     "recipe.json is not valid JSON"),
    ("recipe.json with a wrong value",
     lambda e: ["export", "--model", e.ckpt_with("recipe.json", '{"w_bits": "four"}'), "--out", e.tmp / "x.pte"],
     "recipe.json is not a recipe"),
    ("checkpoint config.json that is not JSON", lambda e: ["eval", "--model", e.ckpt_with("config.json", "[1, 2")],
     "config.json is not valid JSON"),
    ("export over another export's tokenizer files without --force", _export_over_tokenizer,
     "tokenizer.json already exists in"),
    (".pte that does not exist", lambda e: ["generate", e.tmp / "none.pte", "--prompt", "hi"], ".pte not found"),
    ("a file that is not a .pte program",
     lambda e: ["generate", e.file("bad.pte", b"not a flatbuffer" * 10), "--tokenizer", e.pte.parent, "--prompt", "hi"],
     "is not an ExecuTorch program"),
    ("--tokenizer that is not a tokenizer.json",
     lambda e: ["generate", e.pte, "--tokenizer", e.file("notes.txt", "some text"), "--prompt", "hi"],
     "is not a tokenizer.json"),
    ("--tokenizer that does not exist",
     lambda e: ["generate", e.pte, "--tokenizer", e.tmp / "gone.json", "--prompt", "hi"], "not found; pass the tokenizer.json"),
    ("prompt longer than the program's context", lambda e: ["generate", e.pte, "--prompt", "word " * 400],
     "but the program's context is 96; shorten it"),
    ("--chat with a tokenizer that has no chat template", lambda e: ["generate", e.pte, "--prompt", "hi", "--chat"],
     "no chat template; drop --chat"),
    ("chat with a model that has no chat template", lambda e: ["chat", e.pte], "this model has no chat template"),
    ("a sampling value out of range", lambda e: ["generate", e.pte, "--prompt", "hi", "--top-p", "0"],
     "--top-p must be in (0, 1] (1 = off)"),
    ("report with nothing to plot", lambda e: ["report", "--out-dir", e.tmp / "plots"], "nothing to plot"),
    ("report --quality file that is not JSON",
     lambda e: ["report", "--quality", e.file("q.json", "{ nope"), "--out-dir", e.tmp / "plots"], "is not valid JSON"),
    ("optimize --resume without a checkpoint",
     lambda e: ["optimize", "--model", e.hf, "--out", e.tmp / "R.bin", "--resume", "--steps", "1"], "no checkpoint"),
]


def _gpt2_dir(e: Env) -> Path:
    d = e.tmp / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return d


def _hf_with(e: Env, name: str, text: str) -> Path:
    d = e.tmp / "hf_copy"
    shutil.copytree(e.hf, d)
    (d / name).write_text(text)
    return d


def _hf_without_tokenizer(e: Env) -> Path:
    d = e.tmp / "notok"
    shutil.copytree(e.hf, d)
    for f in d.glob("tokenizer*"):
        f.unlink()
    return d


def _existing_dir(e: Env) -> Path:
    d = e.tmp / "exists"
    d.mkdir()
    (d / "mine.txt").write_text("keep me")
    return d


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("name,argv,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(name, argv, message, tmp_path, request, capsys):
    env = Env(tmp_path, request)
    args = [str(a) for a in argv(env)]
    before = _tree(tmp_path)
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    print(f"{name}: {lines[0] if lines else err}")  # the message, for docs/errors.md (pytest -rP shows it)
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
    assert _tree(tmp_path) == before, "the failed command wrote, changed or removed files"


def test_docs_list_every_bad_input():
    """docs/errors.md names every case above with the message it gives."""
    doc = DOC.read_text()
    assert len(CASES) >= 20
    for name, _, message in CASES:
        assert name in doc and message in doc, f"docs/errors.md lacks the case {name!r} or its message {message!r}"
