"""KL divergence and top-1 agreement against a reference model (llama-perplexity --kl-divergence's
statistics), for eager models and for a .pte."""

import json
import math

import torch
import torch.nn.functional as F

from spinquant_et.cli import main
from spinquant_et.eval import TokenStats


def test_token_stats_match_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    logits, ref = torch.randn(50, 40, generator=g), torch.randn(50, 40, generator=g)
    ref[:25] = logits[:25] + 0.01 * torch.randn(25, 40, generator=g)  # half the rows: nearly the same prediction
    targets = torch.randint(0, 40, (50,), generator=g)
    stats = TokenStats()
    stats.add(logits[:20], targets[:20], ref[:20])  # in two pieces: sums, not means, are accumulated
    stats.add(logits[20:], targets[20:], ref[20:])
    s = stats.summary()
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean")
    assert math.isclose(s["mean_kl"], kl.item(), rel_tol=1e-5)
    same = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert math.isclose(s["top1_agreement"], same) and 0.5 <= same < 1.0
    assert math.isclose(s["perplexity"], math.exp(F.cross_entropy(logits, targets).item()), rel_tol=1e-5)
    assert math.isclose(s["reference_perplexity"], math.exp(F.cross_entropy(ref, targets).item()), rel_tol=1e-5)


def test_without_a_reference_only_perplexity_is_reported():
    stats = TokenStats()
    stats.add(torch.zeros(3, 8), torch.tensor([1, 2, 3]))
    s = stats.summary()
    assert list(s) == ["perplexity"] and math.isclose(s["perplexity"], 8.0, rel_tol=1e-6)


def test_eval_against_the_float_model(capsys, trained_tiny_dir, tmp_path):
    """A model against itself: KL 0 and full agreement; its W4A4KV4 version: KL > 0, agreement < 1."""
    model = str(trained_tiny_dir)
    args = ["--seq-len", "48", "--windows", "2", "--reference", model, "--json"]
    assert main(["eval", "--model", model, *args]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["mean_kl"] < 1e-6 and same["top1_agreement"] == 1.0 and math.isclose(same["ppl_ratio"], 1.0)
    q = tmp_path / "q"
    assert main(["quantize", "--model", model, "--w-method", "rtn", "--a-bits", "4", "--kv-bits", "4", "--out", str(q)]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(q), *args]) == 0
    quant = json.loads(capsys.readouterr().out)
    assert quant["mean_kl"] > 1e-4 and quant["top1_agreement"] < 1.0
    assert math.isclose(quant["reference_perplexity"], same["perplexity"], rel_tol=1e-6)  # the same tokens


def test_pte_against_its_own_eager_model_agrees(tiny_pte, tiny_ckpt, capsys):
    """The .pte, token by token through its KV cache, against the eager fake-quant model it came from:
    the same next token almost everywhere, and a small KL (the program also quantizes lm_head's input)."""
    assert main(["eval", "--model", str(tiny_pte), "--seq-len", "48", "--windows", "2", "--reference", str(tiny_ckpt),
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["top1_agreement"] > 0.9 and result["mean_kl"] < 0.01, result
