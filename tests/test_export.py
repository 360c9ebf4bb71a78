"""Export to .pte on a tiny model: faithful to the eager model, runnable by our runtime and ExecuTorch's
own TextLLMRunner, with clear errors for what cannot be exported. Lowering is slow, so one program
is built per session and shared."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_MAX_SEQ as MAX_SEQ

from spinquant_et.cli import main
from spinquant_et.errors import SpinQuantError
from spinquant_et.export.build import build_transformer, check_exportable
from spinquant_et.export.model import NearSpill, TransposedInputKronHadamard
from spinquant_et.export.pipeline import _load_checkpoint_dir
from spinquant_et.recipe import QuantRecipe


def assert_same_tokens_where_clear(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Greedy tokens agree at every position whose reference top-two gap exceeds twice that position's
    largest logit error (there no rounding difference can swap them), and such positions are most of them:
    XNNPACK's own int8 activation rounding moves a random tiny model's logits ~1%, which may swap a near tie."""
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (got - ref).abs().amax(-1)
    assert clear.float().mean() >= 0.75
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def _eager_transformer(ckpt):
    tensors, config, arch, recipe, _ = _load_checkpoint_dir(ckpt)
    return build_transformer(tensors, config, arch, recipe, MAX_SEQ), tensors


def test_exported_linears_hold_the_checkpoint_integers(tiny_ckpt):
    model, tensors = _eager_transformer(tiny_ckpt)
    # q, k and v stacked on the output axis: integers and scales kept
    qkv = [tensors[f"model.layers.1.self_attn.{n}_proj.weight"] for n in ("q", "k", "v")]
    assert torch.equal(model.layers[1].attention.wqkv.weight, torch.cat(qkv))
    # gate and up stacked, rows permuted for the one-transpose R4 (160 = 20 x 8): integers kept
    perm = TransposedInputKronHadamard.input_permutation(20, 8)
    expected = torch.cat([tensors[f"model.layers.1.mlp.{n}_proj.weight"][perm] for n in ("gate", "up")])
    assert torch.equal(model.layers[1].feed_forward.w13.weight, expected)
    assert torch.equal(model.layers[0].feed_forward.w2.scales, tensors["model.layers.0.mlp.down_proj.scales"])


def test_export_model_matches_fake_quant_hf_model(tiny_ckpt):
    """The export model (KV cache, int8 cache, R3/R4 in graph) computes what the fake-quant HF model does,
    except the lm_head input, which the program quantizes to int8 (XNNPACK QD8 x QC8W)."""
    got, ref = _export_and_hf_logits(tiny_ckpt, prompt=16, total=24)
    assert ((got - ref).norm() / ref.norm()).item() < 0.03
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def _export_and_hf_logits(ckpt, prompt: int, total: int):
    """Logits of the export model (a prompt, then one token per call through its cache) and of the
    fake-quant HF model, for the positions after the prompt's last but one."""
    from spinquant_et.checkpoint import load_quantized

    model, _ = _eager_transformer(ckpt)
    hf = load_quantized(ckpt).model
    x = torch.randint(0, 384, (1, total))
    ref = hf(x).logits[0, prompt - 1:]
    with torch.no_grad():
        got = [model(x[:, :prompt], torch.tensor([0]))]  # fills the cache the steps then read
        got += [model(x[:, t : t + 1], torch.tensor([t])) for t in range(prompt, total)]
    return torch.cat(got), ref


def test_pte_runs_and_matches_eager_export_model(tiny_pte, tiny_ckpt):
    from spinquant_et.runtime import PteModel, choose_method

    pte = PteModel(tiny_pte)
    assert pte.max_seq_len == MAX_SEQ and pte.near_len == MAX_SEQ // 2
    assert pte.methods == {"forward", "forward_ctx", "forward_near"} and pte.has_spill
    model, _ = _eager_transformer(tiny_ckpt)  # attention over the whole cache throughout
    x = torch.randint(0, 384, (1, 60), generator=torch.Generator().manual_seed(1)).tolist()[0]
    # the prompt through forward_ctx, decode steps up to near_len (48) through forward_near, four tokens at
    # once past it through forward_ctx, then decode steps past half the cache through forward: one cache
    calls = [(x[:12], 0)] + [([x[t]], t) for t in range(12, 48)] + [(x[48:52], 48)] + [([x[t]], t) for t in range(52, 60)]
    used = [choose_method(len(ids), pos + len(ids), MAX_SEQ, pte.methods, pte.near_len) for ids, pos in calls]
    assert used[0] == used[-9] == "forward_ctx" and used[1] == used[-13] == "forward_near" and used[-1] == "forward"
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([ids]), torch.tensor([pos]))[0] for ids, pos in calls])
    got = torch.stack([pte.forward(ids, pos) for ids, pos in calls])
    # XNNPACK's own dynamic quantization rounds a few activations differently from the reference
    # ops; on a random tiny model that moves logits ~1%.
    assert ((got - ref).norm() / ref.norm()).item() < 0.03
    assert_same_tokens_where_clear(got, ref)


def test_metadata_and_tokenizer_beside_the_pte(tiny_pte):
    from spinquant_et.runtime import PteModel

    pte = PteModel(tiny_pte)
    names = pte.program.method_names
    for m in ("get_max_seq_len", "get_max_context_len", "use_kv_cache", "get_eos_ids", "get_bos_id",
              "get_vocab_size", "get_n_layers"):
        assert m in names
    assert pte._meta("get_vocab_size", 0) == 384 and pte._meta("get_n_layers", 0) == 2
    assert (tiny_pte.parent / "tokenizer.json").is_file()
    assert json.loads((tiny_pte.parent / "tiny.recipe.json").read_text())["kv_bits"] == 8


def test_generate_streams_text_and_reports_speed(tiny_pte, capsys):
    code = main(["generate", str(tiny_pte), "--prompt", "def f(x):", "--max-new-tokens", "12"])
    out, err = capsys.readouterr()
    assert code == 0 and out.strip() and "decode 12 tok at" in err and "ttft" in err


def test_greedy_tokens_equal_executorch_text_llm_runner(tiny_pte):
    """Our Python loop and ExecuTorch's stock C++ runner (the mobile apps' code) agree token for token."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    from transformers import AutoTokenizer

    from spinquant_et.runtime import PteModel, generate

    tok = AutoTokenizer.from_pretrained(tiny_pte.parent)
    prompt = "The data model of Python"
    ours, _ = generate(PteModel(tiny_pte), tok.encode(prompt, add_special_tokens=False), 16, stop_at_eos=False)
    pieces: list[str] = []
    runner = TextLLMRunner(str(tiny_pte), str(tiny_pte.parent / "tokenizer.json"))
    runner.generate(prompt, GenerationConfig(echo=False, max_new_tokens=16, temperature=0.0, num_bos=0),
                    token_callback=pieces.append)
    theirs = tok.encode("".join(pieces), add_special_tokens=False)
    assert tok.decode(ours[: len(theirs)]) == "".join(pieces)


def test_eval_of_pte_is_close_to_eager(tiny_pte, tiny_ckpt, capsys):
    args = ["--seq-len", "48", "--windows", "2", "--json"]
    assert main(["eval", "--model", str(tiny_pte), *args]) == 0
    pte_ppl = json.loads(capsys.readouterr().out)["perplexity"]
    assert main(["eval", "--model", str(tiny_ckpt), *args]) == 0
    eager_ppl = json.loads(capsys.readouterr().out)["perplexity"]
    assert abs(pte_ppl / eager_ppl - 1) < 0.05  # random tiny model; SmolLM2's 1% is in test_e2e


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_stacked_qkv_keeps_biases_and_head_norms(tiny_hf_dir, tmp_path, model_type):
    """q/k/v run as one linear with RoPE over all heads (v's rows of the tables are 1 and 0): Qwen2's
    biases and Qwen3's per-head q/k norms (v heads passed through) must give the fake-quant HF logits."""
    ckpt = tmp_path / "q"
    flags = ["--w-method", "rtn", "--kv-bits", "8"]
    assert main(["quantize", "--model", str(tiny_hf_dir[model_type]), *flags, "--out", str(ckpt)]) == 0
    got, ref = _export_and_hf_logits(ckpt, prompt=12, total=20)
    assert ((got - ref).norm() / ref.norm()).item() < 0.03


@pytest.mark.parametrize("kw,match", [
    (dict(w_bits=3), "--w-bits 3"),
    (dict(group_size=48), "--group-size 48"),
    (dict(a_bits=4), "--a-bits 4 with 4-bit weights"),
    (dict(kv_bits=4), "--kv-bits 4"),
])
def test_unsupported_combinations_are_refused_before_any_work(kw, match):
    with pytest.raises(SpinQuantError, match="not exportable to ExecuTorch: " + match):
        check_exportable(QuantRecipe(**kw))


def test_export_cli_errors(tiny_ckpt, tiny_hf_dir, tmp_path, capsys):
    out = tmp_path / "x.pte"
    assert main(["export", "--model", str(tiny_hf_dir["llama"]), "--w-bits", "3", "--out", str(out)]) == 2
    assert main(["export", "--model", str(tiny_ckpt), "--max-seq-len", "4096", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not exportable to ExecuTorch: --w-bits 3" in err
    assert "--max-seq-len 4096 is beyond the model's limit of 512" in err
    assert not out.exists() and not any(p.name.startswith(".x.pte") for p in tmp_path.iterdir())


def test_checkpoint_missing_tensors_is_refused(tiny_ckpt, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    assert main(["export", "--model", str(broken), "--max-seq-len", "64", "--out", str(tmp_path / "b.pte")]) == 2
    assert "missing tensor model.layers.0.mlp.up_proj.weight" in capsys.readouterr().err
    assert not (tmp_path / "b.pte").exists()


def test_prompt_longer_than_context_is_refused(tiny_pte, capsys):
    assert main(["generate", str(tiny_pte), "--prompt", "word " * 400]) == 2
    assert f"but the program's context is {MAX_SEQ}; shorten it" in capsys.readouterr().err
    from spinquant_et.runtime import PteModel, generate

    with pytest.raises(SpinQuantError, match=f"the program's context is {MAX_SEQ}; shorten it"):
        generate(PteModel(tiny_pte), list(range(1, 200)))


def test_a_file_that_is_not_a_program(tmp_path, capsys):
    bad = tmp_path / "bad.pte"
    bad.write_bytes(b"not a flatbuffer at all" * 10)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["generate", str(bad), "--prompt", "hi"]) == 2
    assert "is not an ExecuTorch program" in capsys.readouterr().err


def test_export_straight_from_a_float_model(tiny_hf_dir, tmp_path):
    """`export --model <HF dir>` quantizes with the recipe flags (layer by layer, from the shards), then lowers."""
    from spinquant_et.runtime import PteModel, generate

    out = tmp_path / "direct.pte"
    assert main(["export", "--model", str(tiny_hf_dir["qwen3"]), "--max-seq-len", "64", "--out", str(out)]) == 0
    pte = PteModel(out)
    ids, stats = generate(pte, [5, 6, 7, 8], 8, stop_at_eos=False)
    assert len(ids) == 8 and stats.prompt_tokens == 4
    # forward_near (attention over the near cache) computes what forward (the whole cache) does
    assert pte.methods == {"forward", "forward_ctx", "forward_near"} and pte.near_len == 32
    x = [5, 6, 7, 8, *ids]
    by_ctx = torch.stack([pte.forward(x[:4], 0)] + [pte.forward([x[t]], t) for t in range(4, 12)])
    pte.methods = {"forward"}
    by_forward = torch.stack([pte.forward(x[:4], 0)] + [pte.forward([x[t]], t) for t in range(4, 12)])
    assert ((by_ctx - by_forward).norm() / by_forward.norm()).item() < 1e-4
    assert torch.equal(by_ctx.argmax(-1), by_forward.argmax(-1))
    assert json.loads((tmp_path / "direct.recipe.json").read_text())["rotation"] == "hadamard"


def test_et_llama_ops_compute_what_the_portable_program_computes(tiny_hf_dir, tmp_path):
    """--ops et-llama swaps the cache write and attention for llama::update_cache/custom_sdpa; eager
    and lowered, it must give the portable model's logits (qwen3: q/k norms on that path too)."""
    from spinquant_et.runtime import PteModel

    ckpt, out = tmp_path / "q", tmp_path / "et.pte"
    assert main(["quantize", "--model", str(tiny_hf_dir["qwen3"]), "--out", str(ckpt)]) == 0
    tensors, config, arch, recipe, _ = _load_checkpoint_dir(ckpt)
    portable = build_transformer(tensors, config, arch, recipe, MAX_SEQ)
    et_llama = build_transformer(tensors, config, arch, recipe, MAX_SEQ, ops="et-llama")
    x = torch.randint(0, 384, (20,), generator=torch.Generator().manual_seed(3)).tolist()

    def decode(step):
        return torch.stack([step(x[:12], 0)] + [step([x[t]], t) for t in range(12, 20)])

    def eager(model):
        return lambda ids, pos: model(torch.tensor([ids]), torch.tensor([pos])).reshape(-1)

    with torch.no_grad():
        ref, got = decode(eager(portable)), decode(eager(et_llama))
    # same arithmetic in another order (attention over the valid prefix only): float rounding, which
    # can flip an int8 activation rounding now and then (see test_pte_runs_and_matches_eager_export_model)
    assert ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.03
    assert torch.equal(got.argmax(-1), ref.argmax(-1))

    assert main(["export", "--model", str(ckpt), "--ops", "et-llama", "--max-seq-len", str(MAX_SEQ), "--out", str(out)]) == 0
    pte = PteModel(out)
    assert pte._meta("use_sdpa_with_kv_cache", None) is True
    lowered = decode(pte.forward)
    assert ((lowered - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 0.03
    # a random model has near-ties; XNNPACK's rounding may swap one (SmolLM2's greedy parity is in test_e2e)
    assert (lowered.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_et_llama_ops_refuse_an_int8_kv_cache(tiny_ckpt, tmp_path, capsys):
    assert main(["export", "--model", str(tiny_ckpt), "--ops", "et-llama", "--out", str(tmp_path / "x.pte")]) == 2
    assert "--ops et-llama keeps a float KV cache" in capsys.readouterr().err


@pytest.mark.parametrize("kv_bits", [8, 16])
def test_attention_over_the_filled_context_computes_what_the_whole_cache_computes(tiny_hf_dir, kv_bits):
    """forward_ctx's attention reads the cache's first len(ctx) positions only: the positions it skips
    are masked out anyway, so prefill and decode give the whole-cache logits (float or int8 cache),
    also when len(ctx) is more than the filled context."""
    from spinquant_et.models import load_model
    from spinquant_et.quantize import quantize

    loaded = load_model(str(tiny_hf_dir["llama"]))
    qm = quantize(loaded, QuantRecipe(w_method="rtn", kv_bits=kv_bits), progress=False)
    model = build_transformer(qm.checkpoint_tensors(), loaded.model.config, loaded.arch, qm.recipe, MAX_SEQ)
    x = torch.randint(0, 384, (40,), generator=torch.Generator().manual_seed(1))
    logits = {}
    for extra in (None, 0, 7):  # whole cache; exactly the filled context; 7 positions more
        def ctx(filled, extra=extra):
            return None if extra is None else torch.zeros(filled + extra)

        with torch.no_grad():
            steps = [model(x[None, :10], torch.tensor([0]), ctx(10))[0]]
            steps += [model(x[None, t : t + 1], torch.tensor([t]), ctx(t + 1))[0] for t in range(10, 40)]
        logits[extra] = torch.stack(steps)
    for extra in (0, 7):
        assert torch.allclose(logits[extra], logits[None], rtol=1e-4, atol=1e-4)


def test_runners_take_forward_ctx_for_prompts_and_for_decode_up_to_half_the_cache():
    from spinquant_et.runtime import choose_method, use_ctx_method

    assert use_ctx_method(100, 100, 2048) and use_ctx_method(1500, 1500, 2048)  # prompts: the copy is shared
    assert use_ctx_method(1, 1024, 2048) and not use_ctx_method(1, 1025, 2048)  # decode: up to half the cache
    assert not use_ctx_method(2, 2048, 2048)  # the very last position: forward's
    # decode steps through forward_near while the filled context fits its cache, never past it; prompts never
    every = {"forward", "forward_ctx", "forward_near"}
    assert choose_method(1, 256, 2048, every, 256) == "forward_near"
    assert choose_method(200, 256, 2048, every, 256) == choose_method(2, 3, 2048, every, 256) == "forward_ctx"
    assert choose_method(1, 257, 2048, every, 256) == "forward_ctx"
    assert choose_method(1, 100, 2048, {"forward", "forward_ctx"}, 256) == "forward_ctx"
    assert choose_method(1, 100, 2048, {"forward"}, 0) == "forward"


@pytest.mark.parametrize("kv_bits", [8, 16])
def test_near_cache_attention_computes_what_the_whole_cache_computes(tiny_hf_dir, kv_bits):
    """forward_near reads a copy of the first near_len positions that every method writes (positions past it
    go to a row no query sees) and writes only that copy; spill_near then brings the cache up to date:
    switching methods mid-sequence gives the whole-cache logits, and the spilled cache is the one that
    forward's own writes leave (an int8 cache: the same integers, its scales equal to float rounding)."""
    from spinquant_et.models import load_model
    from spinquant_et.quantize import quantize

    loaded = load_model(str(tiny_hf_dir["llama"]))
    qm = quantize(loaded, QuantRecipe(w_method="rtn", kv_bits=kv_bits), progress=False)
    args = (qm.checkpoint_tensors(), loaded.model.config, loaded.arch, qm.recipe, MAX_SEQ)
    near, whole = build_transformer(*args, near_len=16), build_transformer(*args)
    assert near.args.near_len == 16 and whole.args.near_len == 0
    x = torch.randint(0, 384, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = [whole(x[:, :10], torch.tensor([0]))] + [whole(x[:, t : t + 1], torch.tensor([t])) for t in range(10, 40)]
        near.near = True  # what forward_near runs, up to position 15
        got = [near(x[:, :10], torch.tensor([0]))] + [near(x[:, t : t + 1], torch.tensor([t])) for t in range(10, 16)]
        near.near = False
        NearSpill(near)()  # what the runners call before a method that reads the cache
        for name, buf in whole.layers[1].attention.cache.named_buffers():
            spilled = near.layers[1].attention.cache.get_buffer(name)
            if name in ("k", "v"):  # the integers (or floats) the whole-cache run wrote
                assert torch.equal(spilled[:, :16], buf[:, :16]), name
            elif not name.startswith("near_"):  # scales to float rounding; zero points exact
                torch.testing.assert_close(spilled[:, :16], buf[:, :16], rtol=1e-6, atol=0)
        # then the window and the whole cache
        got += [near(x[:, t : t + 1], torch.tensor([t]), torch.zeros(t + 1)) for t in range(16, 28)]
        got += [near(x[:, t : t + 1], torch.tensor([t])) for t in range(28, 40)]
        near.near = True  # positions 16.. went to the near cache's last row: a near read still sees 0..15 only
        again = near(x[:, 10:11], torch.tensor([10]))
    torch.testing.assert_close(torch.cat(got), torch.cat(ref), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, ref[1], rtol=1e-4, atol=1e-4)


def test_forward_only_program_and_the_default_context(tiny_ckpt, tmp_path):
    """--forward-only leaves forward_ctx out (our runtime then runs every step through forward); the
    default --max-seq-len is 2048, or the model's limit (512 here) where that is shorter."""
    from spinquant_et.runtime import PteModel, generate

    out = tmp_path / "x.pte"
    assert main(["export", "--model", str(tiny_ckpt), "--forward-only", "--out", str(out)]) == 0
    pte = PteModel(out)
    assert pte.methods == {"forward"} and pte.max_seq_len == 512
    assert json.loads((tmp_path / "x.recipe.json").read_text())["methods"] == ["forward"]
    ids, _ = generate(pte, [5, 6, 7], 4, stop_at_eos=False)
    assert len(ids) == 4


def test_int4_groupwise_lm_head_exports_and_matches_eager(tiny_hf_dir, tmp_path):
    """--lm-head-bits 4: lm_head in int4 groups of --group-size, lowered as 8da4w like the decoder."""
    from spinquant_et.runtime import PteModel

    ckpt, out = tmp_path / "q", tmp_path / "head4.pte"
    assert main(["quantize", "--model", str(tiny_hf_dir["llama"]), "--w-method", "rtn", "--lm-head-bits", "4",
                 "--out", str(ckpt)]) == 0
    tensors, *_ = _load_checkpoint_dir(ckpt)
    head = tensors["lm_head.weight"]
    assert tensors["lm_head.scales"].shape == (384, 96 // 32) and head.min() >= -8 and head.max() <= 7
    assert main(["export", "--model", str(ckpt), "--max-seq-len", "32", "--forward-only",
                 "--out", str(out)]) == 0
    model, _ = _eager_transformer(ckpt)
    x = torch.randint(0, 384, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    pte = PteModel(out)
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([x[:8]]), torch.tensor([0]))[0]]
                          + [model(torch.tensor([[x[t]]]), torch.tensor([t]))[0] for t in range(8, 12)])
    got = torch.stack([pte.forward(x[:8], 0)] + [pte.forward([x[t]], t) for t in range(8, 12)])
    assert ((got - ref).norm() / ref.norm()).item() < 0.03  # as test_pte_runs_and_matches_eager_export_model
    assert_same_tokens_where_clear(got, ref)


def _two_method_program(patched: bool, release: bool = False, also_read=None):
    """Two methods over one int4 linear (as forward and forward_ctx share the model's), lowered to
    XNNPACK with or without ``_xnnpack_without_copies`` (releasing the linear's tensors with ``release``);
    ``also_read(linear, y)``: a second output that reads the linear's tensors outside it."""
    import contextlib

    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from spinquant_et.export.lower import _xnnpack_without_copies, releasable_weights
    from spinquant_et.export.model import Int8DynActInt4WeightLinear

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = Int8DynActInt4WeightLinear(torch.randint(-8, 8, (64, 128)), torch.rand(64, 4) / 8, None)

        def forward(self, x):
            y = self.linear(x)
            return y if also_read is None else (y, also_read(self.linear, y))

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(1, 3, 128)
    expected = model(x)
    programs = {name: torch.export.export(model, (x[:, :n],), strict=False) for name, n in (("a", 3), ("b", 1))}
    with _xnnpack_without_copies(releasable_weights(model) if release else []) if patched else contextlib.nullcontext():
        edge = to_edge_transform_and_lower(programs, partitioner={m: [XnnpackPartitioner()] for m in programs})
    blobs = [b for m in programs for _, lowered in edge.exported_program(m).graph_module.named_children()
             for b in lowered.named_data_store_output.buffers]
    return edge, blobs, x, expected, model


def test_lowering_keeps_one_copy_of_each_weight_and_the_same_program():
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
    from executorch.runtime import Runtime

    before = dict(XnnpackBackend.__dict__)
    edge, blobs, x, expected, _ = _two_method_program(patched=True)
    assert dict(XnnpackBackend.__dict__) == before  # ExecuTorch's own behaviour is back
    # both methods serialized the packed weights and scales; the blobs are shared, not equal copies
    assert len(blobs) > len({bytes(b) for b in blobs})
    assert len({id(b) for b in blobs}) == len({bytes(b) for b in blobs})
    plain_edge, plain_blobs, *_ = _two_method_program(patched=False)
    assert len({id(b) for b in plain_blobs}) == len(plain_blobs)  # what the patch saves: one copy per method
    pte = edge.to_executorch().buffer
    assert pte == plain_edge.to_executorch().buffer
    out = Runtime.get().load_program(pte).load_method("a").execute([x])[0]
    # XNNPACK's QD8 x QB4W kernel against the eager model: its own per-token rounding moves an activation
    # by at most one int8 step (1/255 of a token's range), here up to 0.14% of the largest output
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-2 * expected.abs().max().item())


def test_lowering_frees_each_weight_once_packed_and_writes_the_same_program():
    from spinquant_et.export.lower import _check_nothing_released_is_read

    edge, *_, model = _two_method_program(patched=True, release=True)
    tensors = list(model.linear.buffers())
    assert len(tensors) == 3 and all(t.numel() and t.untyped_storage().nbytes() == 0 for t in tensors)
    _check_nothing_released_is_read(edge, ["a", "b"])
    assert edge.to_executorch().buffer == _two_method_program(patched=False)[0].to_executorch().buffer


def test_lowering_refuses_to_write_a_freed_weight_that_is_read_outside_xnnpack():
    from spinquant_et.export.lower import _check_nothing_released_is_read

    # the integers' sum is no XNNPACK operator: the top-level program keeps reading the weight
    edge, *_ = _two_method_program(patched=True, release=True, also_read=lambda linear, y: linear.weight.sum())
    with pytest.raises(RuntimeError, match=r"reads .*weight outside XNNPACK, but its storage was freed"):
        _check_nothing_released_is_read(edge, ["a", "b"])
