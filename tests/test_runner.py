"""The C++ runner (runner/, built by runner/build.sh): its tokenizer equals HF `tokenizers`, its
greedy tokens equal our Python runtime's, it needs neither libtorch nor libpython, and bad input
gets one clear line and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BINARY = ROOT / "runner" / "build" / "spinquant-run"

# Unicode, code, whitespace runs, digits, contractions, emoji, combining marks, CJK, RTL text.
MIXED_TEXT = (
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\t\ttabs\n\n\n"
    "Ünïcödé — “quotes” and 'apostrophes' don't, we'll, I'm; naïve café, 東京 and 北京 ¿qué? مرحبا\n"
    "   leading spaces    and trailing   \r\n"
    "Emoji: 🙂👍🏽 family: 👨‍👩‍👧 flags 🇫🇷 — math: ∑x² ≤ ∞, 3.14159, 1,000,000 and 2024-12-02.\n"
    "e\u0301 (combining) ß ǅ ﬁ ＦＵＬＬＷＩＤＴＨ\u00a0nbsp \u200b zero-width\n"
)


def run(*args, timeout=300):
    return subprocess.run([str(BINARY), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def long_mixed_text() -> str:
    from spinquant_et.data import builtin_text

    return (MIXED_TEXT + builtin_text("test")[:4000] + MIXED_TEXT) * 2  # ~11 kB


def cpp_ids(tokenizer_json: Path, text: str, tmp_path: Path) -> list[int]:
    f = tmp_path / "text.txt"
    f.write_text(text, encoding="utf-8")
    r = run("--tokenizer", tokenizer_json, "--encode", f)
    assert r.returncode == 0, r.stderr
    return [int(x) for x in r.stdout.split()]


def hf_ids(tokenizer_json: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).encode(text, add_special_tokens=False).ids


def test_tokenizer_equals_hf_tokenizers(runner_binary, tiny_pte, tmp_path):
    tok = tiny_pte.parent / "tokenizer.json"
    text = long_mixed_text() + "<|endoftext|>special<|endoftext|>"
    assert len(text.encode()) > 8000
    assert cpp_ids(tok, text, tmp_path) == hf_ids(tok, text)


def test_tokenizer_with_split_and_digits_pre_tokenizers(runner_binary, tiny_tokenizer, tmp_path):
    """Llama-3/Qwen-style files: Split(regex, Isolated) + ByteLevel(use_regex=false), and Digits."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from spinquant_et.data import builtin_text

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([builtin_text("train")[:100_000]], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|begin_of_text|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    text = long_mixed_text()
    assert cpp_ids(path, text, tmp_path) == hf_ids(path, text)


def test_tokenizer_with_an_nfc_normalizer_takes_ascii(runner_binary, tiny_pte, tmp_path):
    """Qwen2's tokenizer.json normalizes to NFC: on ASCII text that is the identity, so ids equal the
    tokenizers library's; other text is refused in one line (the runner carries no Unicode tables)."""
    import json

    from spinquant_et.data import builtin_text

    spec = json.loads((tiny_pte.parent / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFC"}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    text = builtin_text("test")[:4000].encode("ascii", "ignore").decode()
    assert cpp_ids(path, text, tmp_path) == hf_ids(path, text)
    (tmp_path / "accented.txt").write_text("cafe\u0301 caf\u00e9", encoding="utf-8")
    r = run("--tokenizer", path, "--encode", tmp_path / "accented.txt")
    assert r.returncode != 0 and "NFC" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    spec["normalizer"] = {"type": "NFKC"}
    path.write_text(json.dumps(spec))
    r = run("--tokenizer", path, "--encode", tmp_path / "accented.txt")
    assert r.returncode != 0 and "unsupported normalizer NFKC" in r.stderr


def test_greedy_tokens_equal_the_python_runtime(runner_binary, tiny_pte):
    from transformers import AutoTokenizer

    from spinquant_et.runtime import PteModel, generate

    tok = AutoTokenizer.from_pretrained(tiny_pte.parent)
    prompt = "The data model of Python"
    ours, _ = generate(PteModel(tiny_pte), tok.encode(prompt, add_special_tokens=False), 32, stop_at_eos=False)
    r = run("--model", tiny_pte, "--prompt", prompt, "--max-new-tokens", 32, "--ids", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert [int(x) for x in r.stdout.split()] == ours
    assert "decode 31 tok at" in r.stderr and "peak RSS" in r.stderr
    # a warm-up run of the prompt and one step first (benchmarks time warm calls) leaves no trace
    warm = run("--model", tiny_pte, "--prompt", prompt, "--max-new-tokens", 32, "--ids", "--ignore-eos", "--warmup")
    assert warm.returncode == 0, warm.stderr
    assert [int(x) for x in warm.stdout.split()] == ours
    # XNNPACK's weights packed once per method instead of once for all (the default) compute the same
    plain = run("--model", tiny_pte, "--prompt", prompt, "--max-new-tokens", 32, "--ids", "--ignore-eos",
                "--no-weight-cache")
    assert plain.returncode == 0, plain.stderr
    assert [int(x) for x in plain.stdout.split()] == ours


def test_greedy_tokens_past_the_near_cache_equal_the_python_runtime(runner_binary, tiny_pte):
    """80 tokens after a short prompt: forward_near up to position 48, then spill_near and forward (past half
    the cache). A runner that skipped the spill would attend to empty rows; this random model's greedy
    tokens barely depend on the context (the Python runtime's logits are checked in test_export), so the
    runner also says when it spills."""
    from transformers import AutoTokenizer

    from spinquant_et.runtime import PteModel, generate

    tok = AutoTokenizer.from_pretrained(tiny_pte.parent)
    prompt = "The data model of Python"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert len(ids) < 16
    ours, _ = generate(PteModel(tiny_pte), ids, 80, stop_at_eos=False)
    r = run("--model", tiny_pte, "--prompt", prompt, "--max-new-tokens", 80, "--ids", "--ignore-eos", "--verbose")
    assert r.returncode == 0, r.stderr
    assert [int(x) for x in r.stdout.split()] == ours
    spills = [line for line in r.stderr.splitlines() if "spill_near" in line]
    assert spills == ["spinquant-run: spill_near before forward at position 48"], spills


def test_text_output_streams_whole_characters(runner_binary, tiny_pte):
    """Valid UTF-8 however the tokens fall, and the text HF's tokenizer decodes from the same ids (lone
    or broken byte tokens become U+FFFD there too; the tiny model happens to emit such bytes)."""
    from transformers import AutoTokenizer

    r = run("--model", tiny_pte, "--prompt", "Unicode: café 東京", "--max-new-tokens", 24)
    assert r.returncode == 0, r.stderr
    r.stdout.encode("utf-8")  # valid text (subprocess decoded it strictly as UTF-8)
    ids = run("--model", tiny_pte, "--prompt", "Unicode: café 東京", "--max-new-tokens", 24, "--ids").stdout.split()
    assert r.stdout.rstrip("\n") == AutoTokenizer.from_pretrained(tiny_pte.parent).decode([int(i) for i in ids])


def test_no_libtorch_no_libpython(runner_binary):
    ldd = subprocess.run(["ldd", str(runner_binary)], capture_output=True, text=True).stdout
    libs = [line.split()[0] for line in ldd.splitlines() if line.strip()]  # names, not the paths they resolve to
    assert "libexecutorch.so" in libs and "not found" not in ldd
    assert not [lib for lib in libs if "libtorch" in lib or "libc10" in lib or "python" in lib], libs


@pytest.mark.parametrize("case", ["missing", "corrupt", "tokenizer", "too_long", "chat", "sampling"])
def test_bad_input_is_one_line_and_nonzero(runner_binary, tiny_pte, tmp_path, case):
    tok = tiny_pte.parent / "tokenizer.json"
    if case == "missing":
        r, expect = run("--model", tmp_path / "nope.pte", "--tokenizer", tok, "--prompt", "hi"), ".pte not found"
    elif case == "corrupt":
        bad = tmp_path / "bad.pte"
        bad.write_bytes(b"not a program" * 100)
        r, expect = run("--model", bad, "--tokenizer", tok, "--prompt", "hi"), "is not an ExecuTorch program"
    elif case == "tokenizer":
        bad = tmp_path / "tokenizer.json"
        bad.write_text("{ this is not json")
        r, expect = run("--model", tiny_pte, "--tokenizer", bad, "--prompt", "hi"), "is not valid JSON"
    elif case == "too_long":
        r, expect = run("--model", tiny_pte, "--prompt", "word " * 400), "but the program's context is 96"
    elif case == "sampling":
        r, expect = run("--model", tiny_pte, "--prompt", "hi", "--top-p", "0"), "--top-p must be in (0, 1]"
    else:
        r, expect = run("--model", tiny_pte, "--prompt", "hi", "--chat"), "no chat template"
    lines = r.stderr.splitlines()  # one line: ExecuTorch's own log lines are kept back (shown with --verbose)
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], r.stderr


def test_a_program_with_llama_custom_ops_names_the_fix(runner_binary, tiny_hf_dir, tmp_path):
    """--ops et-llama programs need ExecuTorch's custom-op library, which this runtime leaves out."""
    from spinquant_et.cli import main

    ckpt, pte = tmp_path / "q", tmp_path / "et.pte"
    assert main(["quantize", "--model", str(tiny_hf_dir["llama"]), "--out", str(ckpt)]) == 0
    assert main(["export", "--model", str(ckpt), "--ops", "et-llama", "--max-seq-len", "32", "--out", str(pte)]) == 0
    r = run("--model", pte, "--prompt", "hi")
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "re-export with --ops portable" in lines[0], r.stderr
    assert "llama::" in lines[0]  # the operator ExecuTorch's (kept back) log names as missing
    verbose = run("--model", pte, "--prompt", "hi", "--verbose")
    assert "Missing operator" in verbose.stderr and verbose.stderr.splitlines()[-1] == lines[0]


def test_build_without_an_executorch_python_is_one_line(tmp_path):
    """build.sh takes $PYTHON, else .venv's, else the python on PATH; one that lacks executorch is
    named with the fix, not a CMake error page."""
    script = Path(__file__).parents[1] / "runner" / "build.sh"
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": "/bin/false"})
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "no Python with executorch found" in lines[0], r.stderr


SAMPLING_CASES = [
    [],
    ["--temperature", "0.8", "--seed", "3"],
    ["--temperature", "1.2", "--top-k", "40", "--min-p", "0.05", "--repeat-penalty", "1.3", "--seed", "7"],
    ["--temperature", "0.7", "--top-p", "0.5", "--repeat-penalty", "0.8", "--repeat-last-n", "8", "--seed", "9"],
    ["--repeat-penalty", "1.5"],
    ["--temperature", "1.5", "--top-p", "1", "--seed", "2"],
    ["--temperature", "1.0", "--top-p", "0.999", "--min-p", "0.02", "--seed", "5"],
]


def _sampling_config(flags):
    from spinquant_et.sampling import SamplingConfig

    names = {"--temperature": ("temperature", float), "--top-k": ("top_k", int), "--top-p": ("top_p", float),
             "--min-p": ("min_p", float), "--repeat-penalty": ("repeat_penalty", float),
             "--repeat-last-n": ("repeat_last_n", int), "--seed": ("seed", int)}
    return SamplingConfig(**{names[k][0]: names[k][1](v) for k, v in zip(flags[::2], flags[1::2], strict=True)})


@pytest.mark.parametrize("flags", SAMPLING_CASES, ids=lambda f: " ".join(f) or "greedy")
def test_sampled_tokens_equal_the_python_runtime_for_a_seed(runner_binary, tiny_pte, flags):
    """Same flags, same seed: the same 24 tokens from both runners (same float64 arithmetic, same SplitMix64
    draws). The tiny model's logits agree between the runners to float rounding, far from the draws' edges."""
    from transformers import AutoTokenizer

    from spinquant_et.runtime import PteModel, generate

    tok = AutoTokenizer.from_pretrained(tiny_pte.parent)
    prompt = "The data model of Python"
    ours, _ = generate(PteModel(tiny_pte), tok.encode(prompt, add_special_tokens=False), 24, stop_at_eos=False,
                       sampling=_sampling_config(flags))
    r = run("--model", tiny_pte, "--prompt", prompt, "--max-new-tokens", 24, "--ids", "--ignore-eos", *flags)
    assert r.returncode == 0, r.stderr
    assert [int(x) for x in r.stdout.split()] == ours
    if "--temperature" in flags:
        assert len(set(ours)) > 3  # it did sample


def interactive(pte, stdin: str, *flags, binary=None, prefix=()):
    return subprocess.run([*prefix, str(binary or BINARY), "--model", str(pte), "--interactive", *map(str, flags)],
                          input=stdin, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("flags", [[], ["--temperature", "0.9", "--top-k", "20", "--seed", "4"]], ids=["greedy", "sampled"])
def test_interactive_chat_equals_the_python_chat(runner_binary, tiny_chat_pte, flags):
    """Three turns through `--interactive` and through spinquant_et.chat.ChatSession: the same reply tokens, and
    a stats line per turn whose prefill counts that turn's tokens only."""
    from transformers import AutoTokenizer

    from spinquant_et.chat import ChatSession, ChatTemplate
    from spinquant_et.runtime import PteModel

    turns = ["hello", "tell me more about the data model", "and the last one"]
    r = interactive(tiny_chat_pte, "\n".join(turns) + "\n", "--max-new-tokens", 10, "--ids", *flags)
    assert r.returncode == 0, r.stderr
    cpp_replies = [[int(x) for x in line.split()] for line in r.stdout.splitlines()]
    tok = AutoTokenizer.from_pretrained(tiny_chat_pte.parent)
    session = ChatSession(PteModel(tiny_chat_pte), lambda s: tok.encode(s, add_special_tokens=False),
                          ChatTemplate.from_file(tiny_chat_pte.parent / "chat.json"), max_new_tokens=10,
                          sampling=_sampling_config(flags))
    results = [session.turn(t) for t in turns]
    assert cpp_replies == [res.reply for res in results]
    prefills = [int(line.split("prefill ")[1].split()[0]) for line in r.stderr.splitlines() if "prefill " in line]
    assert prefills == [res.prefill_tokens for res in results]
    assert prefills[1] < prefills[0] + len(results[0].reply)  # not the whole conversation again


def test_interactive_chat_survives_a_full_context_and_a_too_long_turn(runner_binary, tiny_chat_pte):
    """30 piped turns in a 96-token context: notices, no error; a turn longer than the context gets one error line
    and the chat goes on; /reset starts over; /exit ends before the last line."""
    turns = [f"question number {i} about the data model" for i in range(30)]
    turns[5] = "word " * 200
    turns[12] = "/reset"
    r = interactive(tiny_chat_pte, "\n".join([*turns, "/exit", "never read"]) + "\n", "--max-new-tokens", 8)
    assert r.returncode == 0, r.stderr
    err = r.stderr.splitlines()
    assert len([line for line in err if line.startswith("ttft ")]) == 28, r.stderr
    errors = [line for line in err if line.startswith("error:")]
    assert len(errors) == 1 and "shorten it (the conversation goes on without it)" in errors[0], errors
    assert "note: conversation reset" in err
    assert any(line.startswith("note: context full (96 tokens): dropped the oldest") for line in err), r.stderr
    stop = interactive(tiny_chat_pte, "\n".join(turns[:12]) + "\n", "--max-new-tokens", 8, "--stop-when-full")
    assert stop.returncode == 0 and "the chat ends (--stop-when-full)" in stop.stderr, stop.stderr


def test_interactive_needs_a_multi_turn_template(runner_binary, tiny_pte, tiny_chat_pte, tmp_path):
    r = interactive(tiny_pte, "hi\n")
    assert r.returncode == 2 and "no chat template" in r.stderr
    import shutil

    shutil.copy(tiny_chat_pte, tmp_path / "m.pte")
    shutil.copy(tiny_chat_pte.parent / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat.json").write_text('{"prefix": "<|endoftext|>user\\n", "suffix": "<|endoftext|>\\n"}')
    r = interactive(tmp_path / "m.pte", "hi\n")
    assert r.returncode == 2 and "no multi-turn template" in r.stderr and len(r.stderr.splitlines()) == 1
    r = run("--model", tiny_chat_pte, "--prompt", "hi", "--interactive")
    assert r.returncode == 2 and "drop --prompt" in r.stderr
