"""``convert``: our quantized checkpoint loads into ExecuTorch's own Llama model the way
``export_llama --preq_mode 8da4w_output_8da8w --preq_group_size 32 --preq_embedding_quantize 8,0
--use_spin_quant native --use_kv_cache`` loads it, and that model computes what our exported
program computes. ExecuTorch's model code is the one the executorch wheel ships
(``executorch.examples.models.llama``), and the last test runs its ``export_llama`` as README shows."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model

from spinquant_et.cli import main
from spinquant_et.errors import SpinQuantError
from spinquant_et.export.build import build_transformer
from spinquant_et.export.convert import CHECKPOINT, PARAMS, hf_to_meta_rows
from spinquant_et.export.pipeline import _load_checkpoint_dir

MAX_SEQ = 64
GROUP = 32


def _hf_dir(root, tokenizer, model_type: str, **overrides):
    loaded = tiny_model(model_type, tie=model_type == "llama", **overrides)
    d = root / f"hf-{model_type}"
    loaded.model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_tokenizer):
    """``{model_type: (checkpoint dir, converted dir)}``; intermediate 128 = 2^7, as ExecuTorch's R4 needs."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for model_type in ("llama", "qwen2", "qwen3"):
        hf = _hf_dir(root, tiny_tokenizer, model_type, intermediate_size=128)
        ckpt, meta = root / f"q-{model_type}", root / f"meta-{model_type}"
        # RTN: these tests compare two programs on the same integers, whatever chose them; on a random
        # model GPTQ's integers left one greedy token of qwen3 on a near-tie (logits within 3% still)
        assert main(["quantize", "--model", str(hf), "--rotation", "hadamard", "--group-size", str(GROUP),
                     "--w-method", "rtn", "--out", str(ckpt)]) == 0
        assert main(["convert", str(ckpt), "--out", str(meta)]) == 0
        out[model_type] = ckpt, meta
    return out


def _executorch_model(meta_dir):
    """What export_llama's ``Llama2Model`` builds for the flags in the module docstring."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama::fast_hadamard_transform)
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs
    from executorch.examples.models.llama.source_transformation.pre_quantization import (
        sanitize_checkpoint_from_pre_quantization,
        transform_embedding_for_pre_quantization,
        transform_linear_for_pre_quantization,
        transform_output_linear_for_pre_quantization,
    )
    from executorch.examples.models.llama.source_transformation.spin_quant import (
        inject_fast_hadamard_transform_native_for_spin_quant,
    )

    checkpoint = torch.load(meta_dir / CHECKPOINT, map_location="cpu", mmap=True, weights_only=True)
    assert next(iter(checkpoint.values())).is_floating_point()  # export_llama reads the dtype from the first key
    params = json.loads((meta_dir / PARAMS).read_text())
    args = ModelArgs(max_seq_len=MAX_SEQ, max_context_len=MAX_SEQ, max_batch_size=1, use_kv_cache=True,
                     enable_dynamic_shape=True, **params)
    assert args.quantization_args["group_size"] == GROUP
    model = construct_transformer(args)
    model = transform_output_linear_for_pre_quantization(model, checkpoint, torch.float32)
    model = transform_linear_for_pre_quantization(model, checkpoint, GROUP, torch.float32)
    model = transform_embedding_for_pre_quantization(model, checkpoint, torch.float32, 8, 0)
    sanitize_checkpoint_from_pre_quantization(checkpoint)
    missing, unexpected = model.load_state_dict(checkpoint, strict=False, assign=True)
    assert not unexpected, unexpected
    assert not [k for k in missing if k.endswith(".weight") or k.endswith(".scales")], missing
    model = inject_fast_hadamard_transform_native_for_spin_quant(model)  # export_llama applies it after loading
    return model.eval()


def _decode(step, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Prefill ``tokens[:prompt_len]`` in one call, then one token per call: ``[steps, V]`` last logits."""
    out = [step(tokens[:prompt_len], 0)]
    out += [step([t], pos) for pos, t in enumerate(tokens[prompt_len:], start=prompt_len)]
    return torch.stack(out)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_executorch_llama_model_runs_the_converted_checkpoint_like_our_program(converted, model_type):
    ckpt, meta = converted[model_type]
    et = _executorch_model(meta)
    tensors, config, arch, recipe, _ = _load_checkpoint_dir(ckpt)
    ours = build_transformer(tensors, config, arch, recipe, MAX_SEQ).eval()

    def et_step(ids, pos):
        logits = et(torch.tensor([ids]), {"input_pos": torch.tensor([pos])})
        return (logits[0] if isinstance(logits, tuple) else logits).reshape(-1)

    def our_step(ids, pos):
        return ours(torch.tensor([ids]), torch.tensor([pos])).reshape(-1)

    tokens = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        got, want = _decode(et_step, tokens, 16), _decode(our_step, tokens, 16)
    # Same integers and the same int8 per-token quantizer (checked: torchao's and ours agree bit for
    # bit on equal inputs). The programs differ only in float rounding order (interleaved vs
    # half-split RoPE, Hadamard kernels): inputs equal to 6e-8 flip an activation's int8 rounding now
    # and then, one flip moves a layer output ~6e-4, and over 2 layers of this random model the
    # logits drift ~1%. 3% bounds that; a wrong layout or scale is off by ~100%.
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 3e-2, err
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_converted_checkpoint_keeps_the_integers_and_unpermutes_q_k(converted):
    ckpt, meta = converted["llama"]
    tensors, config, *_ = _load_checkpoint_dir(ckpt)
    checkpoint = torch.load(meta / CHECKPOINT, weights_only=True)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(checkpoint["layers.0.attention.wq.weight"], hf_to_meta_rows(q, config.num_attention_heads))
    assert torch.equal(checkpoint["layers.1.feed_forward.w2.weight"], tensors["model.layers.1.mlp.down_proj.weight"])
    assert checkpoint["layers.1.feed_forward.w2.scales"].shape == (config.hidden_size, 128 // GROUP)
    assert checkpoint["output.scales"].shape == (config.vocab_size,)  # tied model: explicit output
    assert (meta / "tokenizer.json").exists()


def test_hf_to_meta_rows_inverts_the_hf_permutation():
    w = torch.randn(4 * 16, 8)
    # transformers' convert_llama_weights_to_hf permute (Meta -> HF), as written there
    hf = w.view(4, 16 // 2, 2, 8).transpose(1, 2).reshape(64, 8)
    assert torch.equal(hf_to_meta_rows(hf, 4), w)


@pytest.mark.parametrize("flags, message", [
    (["--group-size", "-1"], "group size"),
    (["--kv-bits", "8"], "no R3"),
])
def test_convert_refuses_what_export_llama_cannot_run(tiny_hf_dir, tmp_path, capsys, flags, message):
    ckpt = tmp_path / "q"
    assert main(["quantize", "--model", str(tiny_hf_dir["llama"]), "--rotation", "none", *flags, "--out", str(ckpt)]) == 0
    assert main(["convert", str(ckpt), "--out", str(tmp_path / "meta")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "meta").exists()


def test_convert_refuses_r4_of_a_size_fast_hadamard_transform_gets_wrong(tiny_hf_dir, tmp_path):
    ckpt = tmp_path / "q"
    assert main(["quantize", "--model", str(tiny_hf_dir["llama"]), "--rotation", "hadamard", "--out", str(ckpt)]) == 0
    with pytest.raises(SpinQuantError, match="intermediate size 160 is not a power of two"):
        from spinquant_et.export.convert import convert

        convert(ckpt, tmp_path / "meta")


def _readme_export_llama() -> list[str]:
    """The ``export_llama`` command of README's convert section, as argv after the interpreter."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "export_llama" in b)
    line = next(li for li in block.replace("\\\n", " ").splitlines() if "export_llama" in li)
    words = shlex.split(line)
    return words[words.index("-m"):]


@pytest.fixture(scope="module")
def unrotated(tmp_path_factory, tiny_tokenizer):
    """README's demo path on a tiny Llama: ``quantize --rotation none`` then ``convert``."""
    root = tmp_path_factory.mktemp("convert_none")
    hf = _hf_dir(root, tiny_tokenizer, "llama")
    ckpt, meta = root / "q", root / "meta"
    assert main(["quantize", "--model", str(hf), "--rotation", "none", "--group-size", str(GROUP), "--w-method", "rtn",
                 "--out", str(ckpt)]) == 0
    assert main(["convert", str(ckpt), "--out", str(meta)]) == 0
    return ckpt, meta


@pytest.mark.parametrize("rotated", [False, True], ids=["readme-demo-path", "rotated-spin-quant-native"])
def test_export_llama_from_the_wheel_lowers_the_converted_checkpoint(converted, unrotated, rotated, tmp_path):
    """ExecuTorch's own ``python -m executorch.examples.models.llama.export_llama``, run as README
    shows it (for a rotated model with ``--use_spin_quant native --use_sdpa_with_kv_cache`` in place of
    ``--use_qat``, as README says), writes a .pte that agrees with our own program's eager model. ~1 min of lowering each."""
    import os
    import subprocess
    import sys

    from spinquant_et.runtime import PteModel

    ckpt, meta = converted["llama"] if rotated else unrotated
    argv = _readme_export_llama()
    if rotated:  # README: "replace --use_qat by --use_spin_quant native --use_sdpa_with_kv_cache"
        at = argv.index("--use_qat")
        argv[at : at + 1] = ["--use_spin_quant", "native", "--use_sdpa_with_kv_cache"]
    (tmp_path / "meta").symlink_to(meta)  # README's relative paths, from this working directory
    pte = tmp_path / "export_llama.pte"
    argv += ["--max_seq_length", str(MAX_SEQ), "--max_context_length", str(MAX_SEQ), "--output_name", str(pte)]
    run = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0 and pte.is_file(), run.stderr[-3000:]

    tensors, config, arch, recipe, _ = _load_checkpoint_dir(ckpt)
    ours = build_transformer(tensors, config, arch, recipe, MAX_SEQ).eval()
    program = PteModel(pte)
    tokens = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        got = _decode(program.forward, tokens, 16)
        want = _decode(lambda ids, pos: ours(torch.tensor([ids]), torch.tensor([pos])).reshape(-1), tokens, 16)
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 3e-2, err  # as above, plus XNNPACK's own rounding (measured ~1%)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
