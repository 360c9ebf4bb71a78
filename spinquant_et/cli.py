"""Command-line front end. Thin: parse flags, call the stage functions, print results."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from . import quiet
from .errors import SpinQuantError
from .recipe import NO_QUANT, QuantRecipe

log = logging.getLogger("spinquant_et")

DEFAULT_MAX_SEQ_LEN = 2048  # = spinquant_et.export.build.DEFAULT_MAX_SEQ_LEN (not imported: it pulls in torch)

VERBOSE_HELP = "debug logging, and the warnings and logs of torch, transformers and ExecuTorch (hidden by default)"
MODEL_HELP = (
    "an HF model directory, a .gguf file, a quantized checkpoint directory (from `quantize`), "
    "a hub id (needs network) or the built-in alias smollm2-135m"
)


def _bits(text: str) -> int:
    value = int(text)
    if not (2 <= value <= 8 or value == NO_QUANT):
        raise argparse.ArgumentTypeError(f"bits must be 2..8, or 16 for float (got {value})")
    return value


def _add_text_flags(p: argparse.ArgumentParser, default_windows: int) -> None:
    p.add_argument("--text-file", help="UTF-8 text to evaluate on; default: the built-in offline text "
                   "(held-out part of CPython's documentation); 'wikitext2' uses datasets (needs network)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--windows", type=int, default=default_windows,
                   help=f"number of non-overlapping windows (default {default_windows})")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default 1)")


def _add_recipe_flags(p: argparse.ArgumentParser) -> None:
    d = QuantRecipe()
    p.add_argument("--rotation", default=d.rotation,
                   help="none | hadamard (random Hadamard R1/R2 + online R3/R4) | path to a SpinQuant R.bin "
                   f"(default {d.rotation})")
    p.add_argument("--w-bits", type=_bits, default=d.w_bits, help=f"weight bits, 16 = float (default {d.w_bits})")
    p.add_argument("--group-size", type=int, default=d.group_size,
                   help=f"input channels per weight scale, -1 = per output channel (default {d.group_size})")
    p.add_argument("--no-clip", dest="w_clip", action="store_false",
                   help="plain max-abs RTN scales instead of the per-group MSE clipping search")
    p.add_argument("--a-bits", type=_bits, default=d.a_bits,
                   help=f"per-token dynamic activation bits on every linear input but lm_head (default {d.a_bits})")
    p.add_argument("--kv-bits", type=_bits, default=d.kv_bits,
                   help=f"KV cache bits, per token and head; 16 = float (default {d.kv_bits})")
    p.add_argument("--a-clip", type=float, default=d.a_clip,
                   help="eager fake-quant only: shrink each token's activation range by this ratio before quantizing "
                   f"(QuaRot/SpinQuant's a_clip_ratio; default {d.a_clip})")
    p.add_argument("--a-clip-search", action="store_true",
                   help="eager fake-quant only, with GPTQ: choose each linear input's clip ratio (1.0 down to 0.7) by "
                   "the output error its quantization adds on 16 calibration windows; overrides --a-clip")
    p.add_argument("--a-sym", action="store_true",
                   help="eager fake-quant only: symmetric activations and K/V (zero point 0) instead of asymmetric "
                   "(XNNPACK's dynamic quantization and our int8 KV cache are asymmetric)")
    p.add_argument("--k-clip", type=float, default=d.k_clip, help=f"eager fake-quant only: K clip ratio (default {d.k_clip})")
    p.add_argument("--v-clip", type=float, default=d.v_clip, help=f"eager fake-quant only: V clip ratio (default {d.v_clip})")
    p.add_argument("--o-per-head", action="store_true",
                   help="eager fake-quant only: quantize o_proj's input per head, as the SpinQuant reference does "
                   "(XNNPACK quantizes per token over all heads)")
    p.add_argument("--embedding-bits", type=_bits, default=d.embedding_bits, help="embedding bits, per row (default 8)")
    p.add_argument("--lm-head-bits", type=_bits, default=d.lm_head_bits,
                   help="lm_head bits: 8 per row, or below 8 in groups of --group-size (4 exports as 8da4w, as "
                   "ExecuTorch's own 4-bit exports) (default 8)")
    p.add_argument("--w-method", choices=["rtn", "gptq"], default=d.w_method,
                   help="gptq: layer-by-layer error compensation on calibration text (SmolLM2 W4A8 .pte: 1.017x FP "
                   "perplexity; about 12 min on 2 cores for 135M); rtn: round to nearest with a per-group clipping "
                   f"search unless --no-clip (seconds, but 1.61x FP perplexity); same integer layout (default {d.w_method})")
    p.add_argument("--act-order", action="store_true", help="GPTQ: visit columns by decreasing Hessian diagonal")
    p.add_argument("--gptq-target", choices=["float", "layer"], default=d.gptq_target,
                   help="GPTQ: float: match the float model's outputs, so each layer also corrects the error its "
                   "inputs carry from earlier layers (GPTAQ; SmolLM2 W4A8 eager, 32 windows: 1.033x FP, ~1.5x the time); "
                   "layer: match the layer's own float weights on its quantized inputs (classic GPTQ, 1.050x) "
                   f"(default {d.gptq_target})")
    p.add_argument("--head-target", action="store_true",
                   help="GPTQ with the float target: aim lm_head at the float logits too (a least-squares map of its "
                   "input, fitted on the calibration windows, before its int8 rounding; SmolLM2 W4A4KV4 1.396x FP with "
                   "it, 1.416x without; W4A8 1.020x with it, 1.018x without, so off by default)")
    p.add_argument("--calib-text", help="GPTQ calibration text: a UTF-8 file, 'wikitext2' (needs datasets and a hub), "
                   "or default the built-in offline text (its calibration part)")
    p.add_argument("--calib-samples", type=int, default=d.calib_samples,
                   help=f"GPTQ calibration windows (default {d.calib_samples})")
    p.add_argument("--calib-seq-len", type=int, default=d.calib_seq_len,
                   help=f"tokens per GPTQ calibration window (default {d.calib_seq_len})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random Hadamard signs and calibration windows (default 0)")


def _recipe(args) -> QuantRecipe:
    return QuantRecipe(
        rotation=args.rotation, w_bits=args.w_bits, group_size=args.group_size, w_clip=args.w_clip,
        a_bits=args.a_bits, kv_bits=args.kv_bits, embedding_bits=args.embedding_bits,
        lm_head_bits=args.lm_head_bits, seed=args.seed, w_method=args.w_method, act_order=args.act_order,
        calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len, a_clip=args.a_clip, k_clip=args.k_clip,
        v_clip=args.v_clip, o_per_head=args.o_per_head, gptq_target=args.gptq_target, a_clip_search=args.a_clip_search,
        a_sym=args.a_sym, head_target=args.head_target,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spinquant-et",
        description="Rotate (SpinQuant/QuaRot), quantize and evaluate Llama-family models for ExecuTorch.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    verbose = argparse.ArgumentParser(add_help=False)  # -v also after the command (default: the one before it)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)

    q = sub.add_parser("quantize", parents=[verbose], help="fuse norms, rotate, quantize weights; write a checkpoint directory",
                       description="Fuse RMSNorms, rotate (R1/R2 offline, R3/R4 online), quantize weights with "
                       "GPTQ (or RTN + clipping), and write a quantized checkpoint directory (safetensors with integer "
                       "weights and scales, recipe.json, tokenizer).")
    q.add_argument("--model", required=True, help=MODEL_HELP)
    _add_recipe_flags(q)
    q.add_argument("--out", required=True, help="output directory (written atomically)")
    q.add_argument("--force", action="store_true", help="overwrite --out if it exists")

    e = sub.add_parser("eval", parents=[verbose], help="perplexity of a float model or a quantized checkpoint",
                       description="Perplexity on non-overlapping windows. A quantized checkpoint runs with its "
                       "recipe's activation/KV bits unless --a-bits/--kv-bits override them; a float model "
                       "runs in float unless they are given.")
    e.add_argument("model_arg", nargs="?", metavar="MODEL", help="the same as --model")
    e.add_argument("--model", help=MODEL_HELP + ", or a .pte (its own forward is evaluated)")
    _add_text_flags(e, default_windows=32)
    e.add_argument("--a-bits", type=_bits, help="override activation bits (fake-quant)")
    e.add_argument("--kv-bits", type=_bits, help="override KV cache bits (fake-quant)")
    e.add_argument("--reference", metavar="MODEL",
                   help="the float model to compare with on the same tokens (e.g. smollm2-135m): adds its perplexity, "
                   "the mean KL divergence KL(P_ref || P_model) per token and the top-1 agreement (the fraction of "
                   "positions where both pick the same next token), as llama-perplexity --kl-divergence reports")
    e.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    x = sub.add_parser("export", parents=[verbose],
                       help="quantize (or take a quantized checkpoint) and lower to an ExecuTorch .pte",
                       description="Quantize --model with the recipe flags (a checkpoint directory from `quantize` is "
                       "exported as it is), build the model with R3/R4 and a KV cache in the graph, lower it to "
                       "XNNPACK (8-bit dynamic activations x int4 groupwise weights) and write, into the folder of "
                       "--out: X.pte, X.recipe.json (recipe, --max-seq-len, methods), and the tokenizer files "
                       "every .pte in that folder shares: tokenizer.json, tokenizer_config.json, chat_template.jinja "
                       "and chat.json (the chat template pre-rendered for the C++ runner) when the tokenizer has "
                       "them. Refuses to overwrite any of them without --force.")
    x.add_argument("--model", required=True, help=MODEL_HELP)
    _add_recipe_flags(x)
    x.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache length = the longest prompt + generation; the program's memory follows it, "
                   f"its speed through our runners does not (forward_near, forward_ctx) (default {DEFAULT_MAX_SEQ_LEN}, or the "
                   "model's max_position_embeddings where that is shorter)")
    x.add_argument("--forward-only", dest="ctx_method", action="store_false",
                   help="lower forward alone, without forward_near (decode steps attending to a copy of the first 255 "
                   "positions, read in place; with spill_near) and forward_ctx (attention over the filled context), "
                   "which our Python and C++ runners call while they fit: a third of the lowering time, but every step "
                   "then attends over the whole --max-seq-len cache")
    x.add_argument("--ops", choices=["portable", "et-llama"], default="portable",
                   help="portable: standard ops + XNNPACK only, runs in any ExecuTorch runtime, ours and the stock "
                   "runners included (default). et-llama: ExecuTorch's llama::update_cache/custom_sdpa, which "
                   "attend only up to the current position (faster decode at long --max-seq-len), but the "
                   "runtime must link ExecuTorch's custom-ops library; float KV cache only")
    x.add_argument("--out", required=True, help="the .pte to write (atomically)")
    x.add_argument("--force", action="store_true", help="overwrite --out and the files beside it that export writes")

    o = sub.add_parser("optimize", parents=[verbose], help="learn R1/R2 with Cayley SGD (SpinQuant); write an R.bin",
                       description="Learn R1 and one R2 per layer, starting from random Hadamards, by Cayley SGD on "
                       "the loss of the fake-quantized model (by default W4A4KV4 and the KL divergence from the "
                       "float model's predictions; frozen weights, straight-through estimators, cosine schedule). "
                       "Writes OUT (R.bin, reference key names) and OUT.loss.json; "
                       "checkpoints to OUT.ckpt. Under torchrun the batch is split over processes (gloo or nccl). "
                       "Then: quantize --rotation OUT.")
    o.add_argument("--model", required=True, help=MODEL_HELP)
    o.add_argument("--out", required=True, help="the R.bin to write")
    o.add_argument("--w-bits", type=_bits, default=4,
                   help="weight bits during training: 4 trains through the deployed RTN+clip quantizer (for RTN "
                   "targets, as the reference README advises); 16 = float, when GPTQ follows (default 4)")
    o.add_argument("--a-bits", type=_bits, default=4, help="activation bits during training (default 4)")
    o.add_argument("--kv-bits", type=_bits, default=4, help="K/V bits during training (default 4)")
    o.add_argument("--group-size", type=int, default=32, help="weight group size when --w-bits < 16 (default 32)")
    o.add_argument("--calib-text", help="UTF-8 file, 'wikitext2' (needs datasets and a hub), or default the built-in "
                   "offline text (its calibration part)")
    o.add_argument("--samples", type=int, default=128, help="calibration windows to draw batches from (default 128)")
    o.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512; the reference uses 2048)")
    o.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    o.add_argument("--lr", type=float, default=1.5, help="Cayley SGD learning rate, cosine-annealed (default 1.5)")
    o.add_argument("--batch-size", type=int, default=2, help="windows per step, over all processes (default 2; the "
                   "reference: 8 x 2048 tokens)")
    o.add_argument("--loss", choices=["ce", "kl"], default="kl",
                   help="ce: next-token cross-entropy on the text (the reference); kl: KL divergence from the float "
                   "model's predictions (one extra forward per step; measures only the quantization damage) (default kl)")
    o.add_argument("--grad-clip", type=float, default=1.0,
                   help="global gradient-norm limit over all rotations, 0 = off (default 1.0, as the reference's HF Trainer)")
    o.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 autocast (default: on with CUDA, or a CPU with native bf16 such as AVX512-BF16/AMX)")
    o.add_argument("--clip-every", type=int, default=20,
                   help="with --w-bits < 16: steps between searches of each weight group's clip ratio (a search costs "
                   "~4 steps on CPU; in between the ratios are applied to the current weights) (default 20)")
    o.add_argument("--a-clip", type=float, default=1.0,
                   help="activation clip ratio during training: use the target recipe's quantize --a-clip (default 1.0)")
    o.add_argument("--k-clip", type=float, default=1.0, help="K clip ratio during training, as quantize --k-clip (default 1.0)")
    o.add_argument("--v-clip", type=float, default=1.0, help="V clip ratio during training, as quantize --v-clip (default 1.0)")
    o.add_argument("--o-per-head", action="store_true",
                   help="quantize o_proj's input per head during training, as quantize --o-per-head")
    o.add_argument("--seed", type=int, default=0, help="seed of the initial Hadamards and of the batches (default 0)")
    o.add_argument("--device", default="auto", help="cpu, cuda or auto: cuda when available (default auto)")
    o.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (default 10)")
    o.add_argument("--resume", action="store_true", help="continue from OUT.ckpt exactly where it stopped")
    o.add_argument("--force", action="store_true", help="overwrite OUT if it exists")

    r = sub.add_parser("report", parents=[verbose],
                       help="PNG plots: linear-input outliers by rotation, perplexity by method, loss curve",
                       description="Writes outliers.png (max/median channel magnitude of every decoder linear's "
                       "input, per layer, without rotation, with random Hadamards and with --learned), and, when "
                       "given, quality.png from `scripts/bench_quality.py --json-out` and loss.png from an "
                       "R.bin.loss.json.")
    r.add_argument("--model", help=MODEL_HELP)
    r.add_argument("--learned", help="an R.bin from `optimize`, plotted as a third rotation")
    r.add_argument("--quality", help="a JSON written by scripts/bench_quality.py --json-out")
    r.add_argument("--loss", help="an R.bin.loss.json written by `optimize`")
    r.add_argument("--windows", type=int, default=4, help="calibration windows for the outlier statistics (default 4)")
    r.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    r.add_argument("--out-dir", default="report", help="where the PNGs (and outliers.json) go (default ./report)")

    c = sub.add_parser("convert", parents=[verbose], help="quantized checkpoint -> ExecuTorch's pre-quantized Llama checkpoint",
                       description="Write consolidated.00.pth (Meta key names and RoPE layout, int8 tensors holding "
                       "int4 values with fp32 .scales, int8 embeddings and output) and params.json, the input of "
                       "ExecuTorch's own export_llama: --checkpoint OUT/consolidated.00.pth --params "
                       "OUT/params.json --preq_mode 8da4w_output_8da8w --preq_group_size G "
                       "--preq_embedding_quantize 8,0 --use_spin_quant native. The integers are copied as they are.")
    c.add_argument("checkpoint", help="a checkpoint directory written by `quantize`")
    c.add_argument("--out", required=True, help="output directory (written atomically)")
    c.add_argument("--force", action="store_true", help="overwrite --out if it exists")

    g = sub.add_parser("generate", parents=[verbose], help="stream text from a .pte",
                       description="Prefill the prompt, decode with the program's KV cache, stream text to stdout; "
                       "time to first token and tokens/s go to stderr.")
    g.add_argument("pte", help="the .pte file")
    g.add_argument("--tokenizer", help="tokenizer.json or its directory (default: beside the .pte)")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    _add_sampling_flags(g)

    ch = sub.add_parser("chat", parents=[verbose], help="multi-turn chat with a .pte (turns from stdin)",
                        description="A conversation with a .pte: each line on stdin (a terminal or a pipe) is a "
                        "user turn, wrapped in the model's chat template; the reply streams to stdout and a stats "
                        "line per turn goes to stderr. The conversation stays in the program's KV cache, so only "
                        "the new turn's tokens are prefilled. /reset starts a new conversation, /exit (or end of "
                        "input) ends the chat. When a turn does not fit the context, the oldest turns are dropped "
                        "and the rest is prefilled again (--stop-when-full ends the chat instead); a turn longer "
                        "than the whole context gets a one-line error and the chat goes on.")
    ch.add_argument("pte", help="the .pte file (its chat.json or tokenizer chat template beside it)")
    ch.add_argument("--tokenizer", help="tokenizer.json or its directory (default: beside the .pte)")
    ch.add_argument("--system", help="a system prompt (default: the chat template's own, if it has one)")
    ch.add_argument("--max-new-tokens", type=int, default=128,
                    help="the longest reply, in tokens (default 128); each turn keeps room for it, up to a "
                    "quarter of the context")
    ch.add_argument("--stop-when-full", action="store_true",
                    help="end the chat when the context is full instead of dropping the oldest turns")
    _add_sampling_flags(ch)

    b = sub.add_parser("bench", parents=[verbose], help="prefill/decode tokens/s of a .pte over repeats",
                       description="Runs generate N times (greedy, no EOS stop) and reports min/median/max.")
    b.add_argument("pte", help="the .pte file")
    b.add_argument("--tokenizer", help="tokenizer.json or its directory (default: beside the .pte)")
    b.add_argument("--prompt", default="Rotations make quantization easier because", help="prompt text")
    b.add_argument("--prompt-tokens", type=int, default=0, help="instead of --prompt: this many tokens of built-in text")
    b.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
    b.add_argument("--repeats", type=int, default=5, help="default 5")
    b.add_argument("--forward-only", action="store_true",
                   help="prefill and decode through forward (attention over the whole cache), as ExecuTorch's "
                   "stock runners do, instead of the program's forward_near and forward_ctx")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """llama.cpp's sampling controls, with its meanings and order (spinquant_et/sampling.py); the C++ runner
    takes the same flags and draws the same tokens for a seed."""
    s = p.add_argument_group("sampling (llama.cpp's order: repeat penalty, top-k, top-p, min-p, temperature)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: all)")
    s.add_argument("--top-p", type=float, default=0.9, help="keep the most likely tokens up to this mass (default 0.9)")
    s.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this fraction as likely as the most likely one (default 0: off)")
    s.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="divide the logits of recent tokens by this (multiply where negative; default 1: off)")
    s.add_argument("--repeat-last-n", type=int, default=64, help="how many recent tokens the penalty sees (default 64)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


def _sampling(args):
    from .sampling import SamplingConfig

    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)


def _preflight(args, recipe: QuantRecipe | None) -> None:
    """What the flags and the model's config decide, checked before any weights load (seconds, not the
    half minute of loading them): text files, group size against every layer's width, an R.bin's shapes."""
    from .data import check_text_source
    from .models.load import config_input_dims, load_config

    check_text_source(getattr(args, "calib_text", None))
    check_text_source(getattr(args, "text_file", None))
    config = load_config(args.model)
    if config is None or recipe is None:
        return
    recipe.check_dims(config_input_dims(config))
    if recipe.rotation.endswith(".bin"):
        from .rotation.io import load_rotations

        load_rotations(recipe.rotation, config)


def cmd_quantize(args) -> int:
    from pathlib import Path

    from .checkpoint import save_quantized
    from .io import refuse_existing
    from .models import load_model
    from .quantize import quantize
    from .stream import can_stream, quantize_streaming

    recipe = _recipe(args)
    refuse_existing(Path(args.out), args.force)  # before minutes of work, not after
    _preflight(args, recipe)
    t0 = time.perf_counter()
    if can_stream(args.model):  # an HF safetensors directory: one decoder layer in memory at a time
        out = quantize_streaming(args.model, recipe, args.out, force=args.force, calib_text=args.calib_text)
    else:
        loaded = load_model(args.model)
        qm = quantize(loaded, recipe, calib_text=args.calib_text)
        out = save_quantized(qm, args.out, force=args.force)
    print(f"wrote {out} ({recipe.label()}) in {time.perf_counter() - t0:.1f}s")
    return 0


def _tokenizer_for(pte: str, explicit: str | None):
    from pathlib import Path

    from .models.load import _load_tokenizer

    where = Path(explicit) if explicit else Path(pte).parent
    if explicit and not where.exists():
        raise SpinQuantError(f"--tokenizer {where} not found; pass the tokenizer.json that export wrote, or its folder")
    if where.is_file():
        return _tokenizer_file(where)
    if not (where / "tokenizer.json").is_file():
        raise SpinQuantError(f"no tokenizer.json in {where}; pass --tokenizer (export writes it beside the .pte)")
    return _load_tokenizer(str(where))


def _tokenizer_file(path):
    """A tokenizer given as a file: its folder's tokenizer (config and chat template too) when it is
    that folder's tokenizer.json, else the file alone; a one-line error when it is not a tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from .models.load import _load_tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for JSON it cannot read
        reason = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
        raise SpinQuantError(f"--tokenizer {path} is not a tokenizer.json ({reason}); pass the tokenizer.json "
                             "that export wrote beside the .pte") from None
    if path.name == "tokenizer.json":
        return _load_tokenizer(str(path.parent))
    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def _eval_windows(tokenizer, args):
    from .data import load_text, token_windows, tokenize

    return token_windows(tokenize(tokenizer, load_text(args.text_file, "test")), args.seq_len, args.windows)


def _reference_model(args):
    """The float model of ``--reference``, run as it is (no fake-quant), or None."""
    if not args.reference:
        return None
    from .models import load_model

    return load_model(args.reference).model


def _print_eval(result: dict, label: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    head, row = ["model", "recipe", "windows x seq", "perplexity"], [
        result["model"], label, f"{result['windows']} x {result['seq_len']}", f"{result['perplexity']:.3f}"]
    if "mean_kl" in result:
        head += ["reference ppl", "ppl / ref", "mean KL (nats)", "top-1 agreement"]
        row += [f"{result['reference_perplexity']:.3f}", f"{result['ppl_ratio']:.4f}", f"{result['mean_kl']:.5f}",
                f"{100 * result['top1_agreement']:.2f}%"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n| " + " | ".join(row) + " |")


def cmd_eval_pte(args) -> int:
    from .data import check_text_source
    from .runtime import PteModel, pte_token_stats

    check_text_source(args.text_file)
    model = PteModel(args.model)
    tokenizer = _tokenizer_for(args.model, None)
    windows = _eval_windows(tokenizer, args)
    reference = _reference_model(args)
    t0 = time.perf_counter()
    stats = pte_token_stats(model, windows, reference=reference)
    result = {"model": args.model, **stats.summary(), "windows": int(windows.shape[0]), "seq_len": args.seq_len,
              "tokens": int(windows.numel()), "reference": args.reference, "seconds": round(time.perf_counter() - t0, 2)}
    _print_eval(result, ".pte", args.json)
    return 0


def cmd_export(args) -> int:
    from pathlib import Path

    from .export.pipeline import export, refuse_existing_outputs

    refuse_existing_outputs(Path(args.out), args.force)
    is_checkpoint = Path(args.model, "recipe.json").is_file()  # exported as it is: its own recipe
    _preflight(args, None if is_checkpoint else _recipe(args))
    result = export(args.model, _recipe(args), args.out, args.max_seq_len, args.force, args.ops, args.calib_text,
                    args.ctx_method)
    secs = ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items())
    print(f"wrote {result.pte} ({result.size_bytes / 2**20:.1f} MiB, {result.recipe.label()}) and "
          f"{result.tokenizer}; {secs}")
    return 0


def _bf16_default(device: str) -> bool:
    """bf16 autocast where matmuls have native bf16: CUDA, or a CPU with AVX512-BF16 or AMX (read at run time)."""
    if device.startswith("cuda"):
        return True
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def cmd_optimize(args) -> int:
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from .data import calibration_windows
    from .io import refuse_existing
    from .models import load_model
    from .rotation.learn import OptimizeConfig, optimize_rotations

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    if not args.resume and rank == 0:
        refuse_existing(out, args.force)
    if world > 1:
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    try:
        cfg = OptimizeConfig(a_bits=args.a_bits, kv_bits=args.kv_bits, w_bits=args.w_bits, group_size=args.group_size,
                             steps=args.steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                             checkpoint_every=args.checkpoint_every, loss=args.loss, grad_clip=args.grad_clip,
                             clip_every=args.clip_every, a_clip=args.a_clip, k_clip=args.k_clip,
                             v_clip=args.v_clip, o_per_head=args.o_per_head,
                             bf16=_bf16_default(args.device) if args.bf16 is None else args.bf16)
        loaded = load_model(args.model)
        samples = calibration_windows(loaded.tokenizer, args.calib_text, args.seq_len, args.samples, args.seed)
        trainer = optimize_rotations(loaded, samples, out, cfg, args.device, args.resume, rank=rank, world=world)
    finally:
        if world > 1:
            dist.destroy_process_group()
    if rank == 0:
        first, last = trainer.losses[0], trainer.losses[-1]
        tokens = trainer.step_done * args.batch_size * args.seq_len
        print(f"wrote {out} after {trainer.step_done} steps (loss {first:.4f} -> {last:.4f}); spent "
              f"{trainer.seconds / 60:.1f} min on {args.device} ({tokens} tokens), peak RSS {trainer.peak_rss_mib:.0f} MiB; "
              f"use it with: quantize --rotation {out}")
    return 0


def cmd_report(args) -> int:
    from pathlib import Path

    from . import report
    from .io import read_json

    if not (args.model or args.quality or args.loss):
        raise SpinQuantError("nothing to plot: give --model, --quality and/or --loss")
    quality = read_json(Path(args.quality), "pass the JSON that scripts/bench_quality.py --json-out wrote") \
        if args.quality else None
    loss = read_json(Path(args.loss), "pass the R.bin.loss.json that optimize wrote") if args.loss else None
    if loss is not None and not (isinstance(loss, dict) and isinstance(loss.get("loss"), list)):
        raise SpinQuantError(f"{args.loss} has no 'loss' list; pass the R.bin.loss.json that optimize wrote")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if args.model:
        from .data import calibration_windows
        from .models import load_model

        base = load_model(args.model)
        windows = calibration_windows(base.tokenizer, None, args.seq_len, args.windows)
        rotations = {"no rotation": "none", "random Hadamard": "hadamard"}
        if args.learned:
            rotations["learned (SpinQuant)"] = args.learned
        ratios = {label: report.outlier_ratios(report.rotated_copy(base, rot), windows)
                  for label, rot in rotations.items()}
        (out_dir / "outliers.json").write_text(json.dumps(ratios, indent=2))
        written.append(report.plot_outliers(ratios, out_dir / "outliers.png",
                                            f"{args.model}: linear-input outliers (float model, {args.windows} x "
                                            f"{args.seq_len} tokens)"))
    if quality is not None:
        written.append(report.plot_quality(quality, out_dir / "quality.png"))
    if loss is not None:
        written.append(report.plot_loss(loss, out_dir / "loss.png"))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def cmd_convert(args) -> int:
    from .export.convert import CHECKPOINT, PARAMS, convert

    out = convert(args.checkpoint, args.out, args.force)
    print(f"wrote {out / CHECKPOINT} and {out / PARAMS}")
    return 0


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise SpinQuantError("this tokenizer has no chat template; drop --chat")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer.encode(prompt, add_special_tokens=False)


def cmd_generate(args) -> int:
    from .runtime import PteModel, TextStreamer, generate

    sampling = _sampling(args)
    model = PteModel(args.pte)
    tokenizer = _tokenizer_for(args.pte, args.tokenizer)
    ids = _prompt_ids(tokenizer, args.prompt, args.chat)
    streamer = TextStreamer(tokenizer, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    _, stats = generate(model, ids, args.max_new_tokens, on_token=streamer, sampling=sampling)
    print()
    print(f"ttft {stats.ttft_s * 1000:.0f} ms | prefill {stats.prompt_tokens} tok at {stats.prefill_tok_s:.1f} tok/s | "
          f"decode {stats.new_tokens} tok at {stats.decode_tok_s:.1f} tok/s", file=sys.stderr)
    return 0


def _chat_template(pte: str, explicit_tokenizer: str | None, tokenizer):
    """The chat.json export wrote (the C++ runner reads the same file), else the tokenizer's own template."""
    from pathlib import Path

    from .chat import CHAT_FILE, ChatTemplate

    where = Path(explicit_tokenizer) if explicit_tokenizer else Path(pte).parent
    chat_json = (where.parent if where.is_file() else where) / CHAT_FILE
    template = ChatTemplate.from_file(chat_json) if chat_json.is_file() else ChatTemplate.from_tokenizer(tokenizer)
    if template is None:
        raise SpinQuantError("this model has no chat template (no chat.json beside the .pte, none in its tokenizer); "
                             "use `generate --prompt` instead")
    if template.turn_prefix is None:
        fallback = ChatTemplate.from_tokenizer(tokenizer)  # a chat.json from before multi-turn chat
        if fallback is None or fallback.turn_prefix is None:
            raise SpinQuantError("this model's chat template does not append turns (it rewrites earlier ones); "
                                 "chat one turn at a time with `generate --chat`")
        template = fallback
    return template


def cmd_chat(args) -> int:
    from .chat import ChatSession, ContextFull
    from .runtime import PteModel, TextStreamer

    sampling = _sampling(args)
    if args.max_new_tokens < 1:
        raise SpinQuantError(f"--max-new-tokens must be >= 1, not {args.max_new_tokens}")
    model = PteModel(args.pte)
    tokenizer = _tokenizer_for(args.pte, args.tokenizer)
    template = _chat_template(args.pte, args.tokenizer, tokenizer)
    session = ChatSession(model, lambda text: tokenizer.encode(text, add_special_tokens=False), template,
                          system=args.system, max_new_tokens=args.max_new_tokens, sampling=sampling,
                          stop_when_full=args.stop_when_full,
                          on_notice=lambda message: print(f"note: {message}", file=sys.stderr, flush=True))
    interactive = sys.stdin.isatty()
    if interactive:
        print("chat: one line per turn; /reset starts over, /exit or Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\r\n")
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            session.reset()
            print("note: conversation reset", file=sys.stderr, flush=True)
            continue
        if not text.strip():
            continue
        streamer = TextStreamer(tokenizer, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        try:
            result = session.turn(text, on_token=streamer)
        except ContextFull as e:  # --stop-when-full: the chat ends here, as asked
            print(f"note: {e}; the chat ends (--stop-when-full)", file=sys.stderr, flush=True)
            break
        except SpinQuantError as e:  # this turn only: the conversation goes on without it
            print(f"error: {e}", file=sys.stderr, flush=True)
            continue
        print(flush=True)
        print(f"prefill {result.prefill_tokens} tok at {result.prefill_tok_s:.1f} tok/s | "
              f"decode {len(result.reply)} tok at {result.decode_tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    return 0


def cmd_bench(args) -> int:
    import statistics

    from .runtime import PteModel, generate
    from .sysinfo import peak_rss_mib

    model = PteModel(args.pte)
    if args.forward_only:
        model.methods = {"forward"}
    tokenizer = _tokenizer_for(args.pte, args.tokenizer)
    if args.prompt_tokens:
        from .data import builtin_text, tokenize

        ids = tokenize(tokenizer, builtin_text("test"))[: args.prompt_tokens].tolist()
    else:
        ids = _prompt_ids(tokenizer, args.prompt, False)
    generate(model, ids, 4, stop_at_eos=False)  # warm-up: first call allocates and packs weights
    runs = [generate(model, ids, args.max_new_tokens, stop_at_eos=False)[1] for _ in range(args.repeats)]
    rows = {"ttft_ms": [r.ttft_s * 1000 for r in runs], "prefill_tok_s": [r.prefill_tok_s for r in runs],
            "decode_tok_s": [r.decode_tok_s for r in runs]}
    summary = {k: {"min": min(v), "median": statistics.median(v), "max": max(v)} for k, v in rows.items()}
    rss = peak_rss_mib()  # the whole process: Python, torch and the program
    if args.json:
        print(json.dumps({"pte": args.pte, "methods": sorted(model.methods), "prompt_tokens": len(ids),
                          "new_tokens": args.max_new_tokens,
                          "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), **summary, "peak_rss_mib": rss}))
    else:
        print(f"{args.pte}: {len(ids)} prompt tokens, {args.max_new_tokens} new, {args.repeats} repeats; "
              f"peak RSS {rss:.0f} MiB")
        print("| metric | min | median | max |\n|---|---|---|---|")
        for k, v in summary.items():
            print(f"| {k} | {v['min']:.1f} | {v['median']:.1f} | {v['max']:.1f} |")
    return 0


def cmd_eval(args) -> int:
    from .eval import token_stats
    from .models import load_model
    from .online import attach_online

    if str(args.model).endswith(".pte"):
        return cmd_eval_pte(args)
    _preflight(args, None)
    loaded = load_model(args.model)
    recipe = loaded.recipe
    a_bits = args.a_bits if args.a_bits is not None else (recipe.a_bits if recipe else NO_QUANT)
    kv_bits = args.kv_bits if args.kv_bits is not None else (recipe.kv_bits if recipe else NO_QUANT)
    attach_online(loaded.model, loaded.arch, bool(recipe and recipe.rotated), a_bits, kv_bits,
                  **(recipe.online_kwargs() if recipe else {}))
    windows = _eval_windows(loaded.tokenizer, args)
    reference = _reference_model(args)
    t0 = time.perf_counter()
    stats = token_stats(loaded.model, windows, args.batch_size, reference=reference)
    result = {
        "model": args.model,
        **stats.summary(),
        "windows": int(windows.shape[0]),
        "seq_len": args.seq_len,
        "tokens": int(windows.numel()),
        "a_bits": a_bits,
        "kv_bits": kv_bits,
        "recipe": json.loads(recipe.to_json()) if recipe else None,
        "reference": args.reference,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    _print_eval(result, recipe.label() if recipe else f"float (A{a_bits} KV{kv_bits})", args.json)
    return 0


COMMANDS = {"optimize": cmd_optimize, "quantize": cmd_quantize, "eval": cmd_eval, "export": cmd_export,
            "convert": cmd_convert, "report": cmd_report, "generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench}
RUNS_PTE = ("generate", "chat", "bench")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "eval":  # `eval X.pte` and `eval --model X.pte` both work
        if (args.model is None) == (args.model_arg is None):
            parser.error("eval takes one model: `eval MODEL` or `eval --model MODEL`")
        args.model = args.model or args.model_arg
    runs_pte = args.command in RUNS_PTE or str(getattr(args, "model", "")).endswith(".pte")
    if runs_pte:
        from .runtime import limit_omp_threads

        if argv is None:  # a command line, not a call from Python: start again with malloc on huge pages
            from .hugepages import restart_with_huge_pages

            restart_with_huge_pages()
        limit_omp_threads()  # before torch loads: MKL/OpenMP threads would fight ExecuTorch's
    quiet.configure(args.verbose)
    if runs_pte:
        from .hugepages import describe

        log.debug("malloc: %s", describe())
    try:
        return COMMANDS[args.command](args)
    except SpinQuantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; no output was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
