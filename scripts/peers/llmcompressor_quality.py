"""llm-compressor on our tokens: its SpinQuant-style rotations + its GPTQ, then fake-quant perplexity.

Runs inside llm-compressor's own virtual environment (its pins differ from ours; ``bench_quality.py
--peers`` builds that venv and calls this file), so it imports nothing from spinquant_et: the float
model comes as an HF directory and the tokens as JSON (``{"calib": [[ids]], "eval": [[ids]]}``,
drawn by bench_quality from the same texts as our own cells). Prints one JSON line per scheme:
perplexity on the evaluation windows, wall seconds of its ``oneshot`` and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import resource
import time


def perplexity(model, windows) -> float:
    import torch

    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logits = model(ids).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return math.exp(nll / count)


def scheme(bits_a: int, group_size: int):
    """W4 symmetric groups of ``group_size`` (ours: the same); A8 per-token asymmetric dynamic (ours: the same)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    acts = None
    if bits_a == 8:
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="token", dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="HF directory of the float model")
    p.add_argument("--tokens", required=True, help="JSON with calib and eval windows of token ids")
    p.add_argument("--a-bits", default="8,16", help="comma-separated activation bits: 8 (W4A8), 16 (W4A16)")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--rotations", default="R1,R2,R4")
    p.add_argument("--transform-type", default="random-hadamard")
    p.add_argument("--transform-block-size", type=int, default=None)
    args = p.parse_args()

    import llmcompressor
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform import SpinQuantModifier
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tokens = json.loads(open(args.tokens).read())
    calib = Dataset.from_dict({"input_ids": tokens["calib"], "attention_mask": [[1] * len(w) for w in tokens["calib"]]})
    base = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    print(json.dumps({"scheme": "FP", "perplexity": perplexity(base, tokens["eval"]),
                      "version": llmcompressor.__version__}), flush=True)
    for a_bits in (int(b) for b in args.a_bits.split(",")):
        model = copy.deepcopy(base)
        recipe = [SpinQuantModifier(rotations=args.rotations.split(","), transform_type=args.transform_type,
                                    transform_block_size=args.transform_block_size),
                  GPTQModifier(config_groups={"group_0": scheme(a_bits, args.group_size)}, ignore=["lm_head"])]
        t0 = time.perf_counter()
        oneshot(model=model, dataset=calib, recipe=recipe, max_seq_length=len(tokens["calib"][0]),
                num_calibration_samples=len(tokens["calib"]))
        seconds = time.perf_counter() - t0
        print(json.dumps({"scheme": f"W4A{a_bits} g{args.group_size}", "perplexity": perplexity(model, tokens["eval"]),
                          "oneshot_s": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                          "rotations": args.rotations, "transform_type": args.transform_type}), flush=True)
        del model


if __name__ == "__main__":
    main()
