"""The CLI on tiny models: the happy path, and one clear line for each kind of bad input."""

import json

import pytest

from spinquant_et.cli import main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, pattern):
    import re

    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and re.search(pattern, lines[0]), err


def test_quantize_then_eval_json(capsys, tiny_hf_dir, tmp_path):
    out = tmp_path / "q"
    code, stdout, _ = run(capsys, "quantize", "--model", tiny_hf_dir["qwen2"], "--rotation", "hadamard",
                          "--a-bits", "4", "--kv-bits", "4", "--out", out)
    assert code == 0 and "W4A4KV4-hadamard" in stdout
    code, stdout, _ = run(capsys, "eval", out, "--seq-len", "64", "--windows", "4", "--json")  # as README writes it
    result = json.loads(stdout)
    assert code == 0 and result["windows"] == 4 and result["kv_bits"] == 4 and result["recipe"]["a_bits"] == 4
    assert 1 < result["perplexity"] < 10_000  # a random model, but a finite, sane number


def test_eval_float_model_with_fake_quant_flags(capsys, tiny_hf_dir):
    code, stdout, _ = run(capsys, "eval", "--model", tiny_hf_dir["llama"], "--seq-len", "64", "--windows", "2", "--json")
    fp = json.loads(stdout)["perplexity"]
    code, stdout, _ = run(capsys, "eval", "--model", tiny_hf_dir["llama"], "--seq-len", "64", "--windows", "2",
                          "--a-bits", "2", "--json")
    assert code == 0 and json.loads(stdout)["perplexity"] != fp


def test_group_size_that_does_not_divide(capsys, tiny_hf_dir, tmp_path):
    code, _, err = run(capsys, "quantize", "--model", tiny_hf_dir["llama"], "--group-size", "64", "--out", tmp_path / "o")
    assert_one_line_error(code, err, r"--group-size 64 does not divide in_features 96")
    assert not (tmp_path / "o").exists()


def test_unsupported_architecture(capsys, tiny_hf_dir, tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, _, err = run(capsys, "eval", "--model", d)
    assert_one_line_error(code, err, r"unsupported architecture 'gpt2'; supported: llama, mistral, qwen2, qwen3")


def test_missing_model(capsys, tmp_path):
    code, _, err = run(capsys, "eval", "--model", tmp_path / "nope.gguf")
    assert_one_line_error(code, err, r"model not found: .*nope.gguf")


def test_corrupt_gguf(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00garbage" * 10)
    code, _, err = run(capsys, "eval", "--model", bad)
    assert_one_line_error(code, err, r"not a readable GGUF file.*re-download")


def test_corrupt_safetensors(capsys, tiny_hf_dir, tmp_path):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(tiny_hf_dir["llama"], d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated download
    code, _, err = run(capsys, "eval", "--model", d)
    assert_one_line_error(code, err, r"could not load .*corrupt or truncated")


def test_missing_tokenizer(capsys, tiny_hf_dir, tmp_path):
    import shutil

    d = tmp_path / "notok"
    shutil.copytree(tiny_hf_dir["llama"], d)
    for f in d.glob("tokenizer*"):
        f.unlink()
    code, _, err = run(capsys, "eval", "--model", d)
    assert_one_line_error(code, err, r"no usable tokenizer.*tokenizer.json")


def test_text_too_short_for_one_window(capsys, tiny_hf_dir, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("only a few words")
    code, _, err = run(capsys, "eval", "--model", tiny_hf_dir["llama"], "--text-file", f, "--seq-len", "512")
    assert_one_line_error(code, err, r"fewer than one window of 512; use a longer text or a smaller --seq-len")


def test_existing_output_directory_is_refused(capsys, tiny_hf_dir, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    code, _, err = run(capsys, "quantize", "--model", tiny_hf_dir["llama"], "--out", out)
    assert_one_line_error(code, err, r"already exists; pass --force")
    code, _, _ = run(capsys, "quantize", "--model", tiny_hf_dir["llama"], "--out", out, "--force")
    assert code == 0 and (out / "recipe.json").is_file()


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    out = capsys.readouterr().out
    for flag in ("--rotation", "--w-bits", "--group-size", "--no-clip", "--a-bits", "--kv-bits", "--out", "--force"):
        assert flag in out


def test_hub_id_without_a_hub_is_a_clear_error(capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never touch the network from a test
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, _, err = run(capsys, "eval", "--model", "someorg/not-a-model")
    assert_one_line_error(code, err, r"could not fetch 'someorg/not-a-model' from the hub .*pass a local directory")


def test_cli_default_context_matches_the_export_default():
    from spinquant_et import cli
    from spinquant_et.export import build

    assert cli.DEFAULT_MAX_SEQ_LEN == build.DEFAULT_MAX_SEQ_LEN


def _readme_commands() -> list[list[str]]:
    """Every `spinquant-et ...` command in README's fenced code blocks, as argv (after the program)."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)  # `&&`, `|` and `;` as their own tokens
            lexer.whitespace_split, lexer.commenters = True, "#"
            words: list[str] = []
            for token in [*lexer, "&&"]:
                if token in ("&&", "|", "||", ";"):
                    if words and words[0].endswith("spinquant-et"):
                        commands.append(words[1:])
                    words = []
                else:
                    words.append(token)
    return commands


def test_readme_commands_parse_and_the_convert_example_runs(capsys, tiny_hf_dir, tmp_path, monkeypatch):
    """README's commands use only flags that exist; its quantize -> convert example, whose float model
    (the demo's) is swapped for the tiny one, runs as written."""
    from spinquant_et.cli import build_parser

    commands = _readme_commands()
    assert {c[0] for c in commands} >= {"export", "generate", "quantize", "convert", "chat"}
    for argv in commands:
        build_parser().parse_args(argv)  # argparse exits on a flag that does not exist
    monkeypatch.chdir(tmp_path)
    for argv in (c for c in commands if c[0] in ("quantize", "convert")):
        argv = [str(tiny_hf_dir["llama"]) if a == "smollm2-135m" else a for a in argv]
        code, _, err = run(capsys, *argv)
        assert code == 0, (argv, err)
    assert (tmp_path / "meta" / "consolidated.00.pth").is_file()
