"""Quantizing one decoder layer at a time (``spinquant_et.stream``): the same checkpoint as the
in-memory path, bit for bit, with at most one decoder layer holding weights at any moment."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

from spinquant_et.checkpoint import load_quantized, read_checkpoint, save_quantized
from spinquant_et.models import load_model
from spinquant_et.quantize import quantize
from spinquant_et.recipe import QuantRecipe
from spinquant_et.shards import INDEX
from spinquant_et.stream import _Streamer, can_stream, quantize_streaming

GPTQ = dict(w_method="gptq", calib_samples=4, calib_seq_len=64)
RECIPES = {
    "hadamard-rtn": dict(w_method="rtn"),
    "none-rtn": dict(w_method="rtn", rotation="none"),
    "hadamard-gptq-w4a8": GPTQ,
    "hadamard-gptq-w4a8-head-target": dict(**GPTQ, head_target=True),
    "hadamard-gptq-w4a4kv4-int4-head": dict(**GPTQ, a_bits=4, kv_bits=4, lm_head_bits=4, o_per_head=True),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tiny_tokenizer):
    """Tiny HF directories: Llama tied (lm_head read from the embeddings), Qwen2 (q/k/v biases),
    Qwen3 (q/k norms), all with non-trivial norms and biases."""
    root = tmp_path_factory.mktemp("stream")
    dirs = {}
    for model_type, tie in (("llama", True), ("qwen2", False), ("qwen3", False)):
        d = root / model_type
        tiny_model(model_type, tie=tie, seed=1).model.save_pretrained(d)
        tiny_tokenizer.save_pretrained(d)
        dirs[model_type] = d
    return dirs


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_streamed_checkpoint_equals_the_in_memory_one(hf_dirs, tmp_path, model_type, recipe):
    """Same functions, same order, same float64 arithmetic: every tensor equal, not merely close."""
    src = hf_dirs[model_type]
    assert can_stream(src)
    save_quantized(quantize(load_model(src), QuantRecipe(**RECIPES[recipe]), progress=False), tmp_path / "mem")
    quantize_streaming(src, QuantRecipe(**RECIPES[recipe]), tmp_path / "stream", progress=False, shard_bytes=100_000)
    assert (tmp_path / "stream" / INDEX).is_file()  # several shards at this size
    want, *_ = read_checkpoint(tmp_path / "mem")
    got, *_ = read_checkpoint(tmp_path / "stream")
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_a_streamed_checkpoint_loads_and_runs_as_its_recipe_says(hf_dirs, tmp_path):
    quantize_streaming(hf_dirs["qwen2"], QuantRecipe(w_method="rtn", a_bits=4, kv_bits=4), tmp_path / "q",
                       progress=False, shard_bytes=100_000)
    save_quantized(quantize(load_model(hf_dirs["qwen2"]), QuantRecipe(w_method="rtn", a_bits=4, kv_bits=4),
                            progress=False), tmp_path / "mem")
    ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = load_quantized(tmp_path / "q").model(ids).logits
        want = load_quantized(tmp_path / "mem").model(ids).logits
    assert torch.equal(got, want)


def test_one_decoder_layer_holds_weights_at_a_time(hf_dirs, tmp_path, monkeypatch):
    """The memory bound, checked structurally: when a layer loads, every other layer is on the meta
    device (holds no storage), for RTN and for GPTQ (whose float twin is a copy of the loaded layer)."""
    seen = []
    load = _Streamer.load_layer

    def watched(self, i, layer):
        others = [j for j, other in enumerate(self.layers) if j != i
                  and any(p.device.type != "meta" for p in other.parameters())]
        seen.append((i, others))
        load(self, i, layer)

    monkeypatch.setattr(_Streamer, "load_layer", watched)
    for name, kw in (("rtn", dict(w_method="rtn")), ("gptq", GPTQ)):
        seen.clear()
        quantize_streaming(hf_dirs["llama"], QuantRecipe(**kw), tmp_path / name, progress=False)
        assert seen == [(0, []), (1, [])], (name, seen)


def test_cli_quantize_streams_an_hf_directory(hf_dirs, tmp_path):
    from spinquant_et.cli import main

    assert main(["quantize", "--model", str(hf_dirs["qwen3"]), "--w-method", "rtn", "--out", str(tmp_path / "q")]) == 0
    save_quantized(quantize(load_model(hf_dirs["qwen3"]), QuantRecipe(w_method="rtn"), progress=False), tmp_path / "mem")
    got, *_ = read_checkpoint(tmp_path / "q")
    want, *_ = read_checkpoint(tmp_path / "mem")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_export_of_an_hf_directory_is_the_export_of_its_streamed_checkpoint(hf_dirs, tmp_path):
    """``export --model HFDIR`` quantizes into a staging checkpoint that the model is built from (read tensor
    by tensor) before the staging goes: the same program as quantizing first and exporting the checkpoint."""
    from spinquant_et.cli import main

    common = ["--w-method", "rtn", "--forward-only", "--max-seq-len", "32"]
    assert main(["export", "--model", str(hf_dirs["qwen2"]), *common, "--out", str(tmp_path / "a" / "m.pte")]) == 0
    assert main(["quantize", "--model", str(hf_dirs["qwen2"]), "--w-method", "rtn", "--out", str(tmp_path / "q")]) == 0
    assert main(["export", "--model", str(tmp_path / "q"), "--forward-only", "--max-seq-len", "32",
                 "--out", str(tmp_path / "b" / "m.pte")]) == 0
    assert (tmp_path / "a" / "m.pte").read_bytes() == (tmp_path / "b" / "m.pte").read_bytes()
    assert not [p.name for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no staging left
