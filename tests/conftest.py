"""Shared fixtures: a real (trained) tiny tokenizer and tiny HF model directories on disk."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import TINY_VOCAB, tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE tokenizer trained in ~1 s on the built-in text (vocab = the tiny models')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from spinquant_et.data import builtin_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([builtin_text("train")[:200_000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, tiny_tokenizer):
    """``{model_type: directory}`` of tiny random HF checkpoints (safetensors + tokenizer)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    dirs = {}
    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        loaded = tiny_model(model_type, tie=model_type == "llama")
        d = root / model_type
        loaded.model.save_pretrained(d)
        tiny_tokenizer.save_pretrained(d)
        dirs[model_type] = d
    return dirs


@pytest.fixture(scope="session")
def trained_tiny_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama trained for ~15 s on the built-in text: unlike a random model, quantizing its
    activations raises its loss, so methods that reduce quantization error (learned rotations,
    GPTQ) have something measurable to reduce."""
    import torch

    from spinquant_et.data import builtin_text, calibration_samples, tokenize

    ids = tokenize(tiny_tokenizer, builtin_text("train")[:400_000])
    loaded = tiny_model("llama", seed=0)
    model = loaded.model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for step in range(100):
        batch = calibration_samples(ids, 64, 16, seed=step)
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().requires_grad_(False)
    d = tmp_path_factory.mktemp("trained_tiny") / "llama"
    model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


TINY_MAX_SEQ = 96


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_hf_dir, tmp_path_factory):
    """Tiny Llama, W4A8 g32, Hadamard R1-R4, int8 KV cache: the checkpoint behind ``tiny_pte``."""
    from spinquant_et.cli import main

    out = tmp_path_factory.mktemp("ckpt") / "q"
    flags = ["--rotation", "hadamard", "--w-bits", "4", "--group-size", "32", "--a-bits", "8", "--kv-bits", "8"]
    assert main(["quantize", "--model", str(tiny_hf_dir["llama"]), *flags, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_pte(tiny_ckpt, tmp_path_factory):
    """``tiny_ckpt`` lowered (portable ops: ``forward``, ``forward_ctx`` and ``forward_near``), tokenizer.json beside it.
    Lowering takes ~40 s: shared."""
    from spinquant_et.cli import main

    out = tmp_path_factory.mktemp("pte") / "tiny.pte"
    assert main(["export", "--model", str(tiny_ckpt), "--max-seq-len", str(TINY_MAX_SEQ), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def runner_binary():
    """runner/build/spinquant-run, built from scratch once per session (CI has no prebuilt binary)."""
    import subprocess

    root = Path(__file__).parents[1]
    build = subprocess.run(["bash", str(root / "runner" / "build.sh")], capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    binary = root / "runner" / "build" / "spinquant-run"
    assert binary.is_file()
    return binary


# ChatML with the tiny tokenizer's one special token as both turn marker and end of turn (its EOS), and a
# default system prompt, as SmolLM2's template has
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|endoftext|>system\nBe brief.<|endoftext|>\n"
    "{% endif %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_chat_pte(tiny_pte, tmp_path_factory):
    """``tiny_pte`` in a folder of its own whose tokenizer has a chat template, and the chat.json export
    renders from it (the C++ runner's template)."""
    import shutil

    from transformers import AutoTokenizer

    from spinquant_et.export.pipeline import stage_tokenizer

    d = tmp_path_factory.mktemp("chat_pte")
    tok = AutoTokenizer.from_pretrained(tiny_pte.parent)
    tok.chat_template = TINY_CHAT_TEMPLATE
    stage_tokenizer(tok, d)  # keeps only the tokenizer's files in d: the program comes after
    shutil.copy(tiny_pte, d / tiny_pte.name)
    return d / tiny_pte.name


AARCH64_SYSROOT = "/usr/aarch64-linux-gnu"
# qemu-user with the cross toolchain's glibc: its loader must load its own libc. With Debian's multiarch libc6:arm64
# also installed, the host's ld.so.cache points at that (another build), and the mix hangs at the first thread.
QEMU_AARCH64 = ["qemu-aarch64", "-L", AARCH64_SYSROOT, "-E", f"LD_LIBRARY_PATH={AARCH64_SYSROOT}/lib"]


@pytest.fixture(scope="session")
def aarch64_runner():
    """runner/build-aarch64/spinquant-run, cross-compiled once per session; skipped, with the reason, only where
    qemu-user or the cross toolchain cannot be installed (scripts/setup.sh installs both when run as root)."""
    import shutil
    import subprocess

    if shutil.which("qemu-aarch64") is None:
        pytest.skip("qemu-aarch64 not found: apt-get install qemu-user (scripts/setup.sh does, as root)")
    root = Path(__file__).parents[1]
    build = subprocess.run(["bash", str(root / "runner" / "build.sh"), "--target", "aarch64"], capture_output=True,
                           text=True, timeout=900)
    if build.returncode == 2 and "needs:" in build.stderr:
        pytest.skip(build.stderr.strip())
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    return root / "runner" / "build-aarch64" / "spinquant-run"
