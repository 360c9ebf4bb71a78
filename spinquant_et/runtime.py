"""Run a ``.pte`` from Python with ExecuTorch's runtime: generation, benchmarking, perplexity.

Threads: ExecuTorch's XNNPACK workers and MKL/OpenMP threads oversubscribe the cores (decode
halves), and ``torch.set_num_threads`` does not reach ExecuTorch, so ``OMP_NUM_THREADS=1`` must be
in the environment before torch loads. The CLI sets it before importing anything heavy;
``limit_omp_threads()`` is for other callers.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import SpinQuantError
from .sampling import SamplingConfig, SplitMix64, sample_token

log = logging.getLogger(__name__)

# forward_ctx(tokens, input_pos, ctx): forward whose attention reads the cache's first len(ctx) positions
CTX_METHOD = "forward_ctx"
# forward_near(token, input_pos): one decode step whose attention reads, in place, a copy of the cache's
# first get_near_len positions (right while the filled context is at most that)
NEAR_METHOD = "forward_near"
# spill_near(): forward_near writes only that copy; this writes it into the cache, once, before a method that
# reads the cache follows forward_near steps (programs without it have a forward_near that writes both)
SPILL_METHOD = "spill_near"


def use_ctx_method(n_tokens: int, filled: int, max_seq_len: int) -> bool:
    """Whether a step of ``n_tokens`` that fills the context to ``filled`` should run forward_ctx.

    forward_ctx copies the filled part of K and V out of the cache (ExecuTorch's slice_copy) before
    attending to it; ``forward`` reads the whole cache in place. A decode step past half the cache
    therefore runs faster through ``forward`` (SmolLM2, 2048 positions: forward_ctx 1.6x forward's
    speed at 128 positions, 1.04x at 1024, 0.95x at 1280, 0.87x at 1536); a prompt's copy is shared
    by all its tokens, so prefill always takes forward_ctx. The very last position must be forward's.
    """
    return filled < max_seq_len and (n_tokens > 1 or 2 * filled <= max_seq_len)


def choose_method(n_tokens: int, filled: int, max_seq_len: int, methods, near_len: int = 0) -> str:
    """The method a call of ``n_tokens`` that fills the context to ``filled`` runs through: a decode step
    while the context fits the near cache runs through forward_near (no copy at all), else forward_ctx as
    ``use_ctx_method`` says, else forward. Prompts skip forward_near: it reads all near_len + 1 positions,
    which costs a short prompt more than forward_ctx's copy of what it fills (SmolLM2, 128 tokens: 88 ms
    against 78). The C++ runner (runner/src/main.cpp) makes the same choice."""
    if NEAR_METHOD in methods and n_tokens == 1 and filled <= near_len:
        return NEAR_METHOD
    if CTX_METHOD in methods and use_ctx_method(n_tokens, filled, max_seq_len):
        return CTX_METHOD
    return "forward"


def limit_omp_threads() -> None:
    """Set OMP_NUM_THREADS=1 unless the user chose a value (effective only before torch is imported)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    ttft_s: float  # time to first token (prefill + first sample)
    prefill_s: float
    decode_s: float

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tok_s(self) -> float:
        steps = self.new_tokens - 1  # the first new token comes from the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s else float("nan")


class PteModel:
    """A loaded ``.pte`` LLM: ``forward(tokens, pos) -> logits`` plus its metadata methods.

    ``etdump=True`` records every operator's time (``program.write_etdump_result_to_file``).
    """

    def __init__(self, path: str | Path, etdump: bool = False):
        import torch  # noqa: F401  (loads libtorch before ExecuTorch's extensions)

        try:  # kernels some programs need; ours need only XNNPACK, but stock et-llama programs use these
            import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
            import executorch.kernels.quantized  # noqa: F401
        except Exception as e:  # pragma: no cover - depends on the wheel
            log.debug("optional ExecuTorch kernels not loaded: %s", e)
        from executorch.runtime import Runtime

        from .quiet import native_stderr, silence_library_loggers

        silence_library_loggers()  # torchao's import-time warnings come through torch's loggers
        self.path = Path(path)
        if not self.path.is_file():
            raise SpinQuantError(f".pte not found: {self.path}")
        with native_stderr() as native:  # ExecuTorch's C++ logs (cpuinfo probes at its first load)
            try:
                self.program = Runtime.get().load_program(self.path, enable_etdump=etdump)
            except Exception:
                self.program = None
            try:
                self.method = self.program and self.program.load_method("forward")
            except Exception:
                self.method = None
        if self.program is None:
            raise SpinQuantError(f"{self.path} is not an ExecuTorch program (corrupt or not a .pte); re-export it")
        if self.method is None:
            missing = sorted(set(re.findall(r"Missing operator: \[\d+\] ([\w:.]+)", native.text)))
            raise SpinQuantError(
                f"{self.path}: this runtime lacks operators the program needs ({', '.join(missing) or 'see -v'}); "
                "re-export with --ops portable"
            )
        # The position input: one start index (ours, export_llama's), or one index per token
        # (transformers' cache_position, as optimum-executorch exports it: its size bound is the prompt's).
        self.positions_per_token = self.program.metadata("forward").input_tensor_meta(1).sizes()[0] > 1
        self.max_seq_len = int(self._meta("get_max_seq_len", 128))
        # the methods our runners choose from (choose_method); methods=("forward",) runs as stock runners do
        self.methods = set(self.program.method_names) & {"forward", CTX_METHOD, NEAR_METHOD}
        self.near_len = int(self._meta("get_near_len", 0))
        self.has_spill = SPILL_METHOD in self.program.method_names
        self._near_unspilled = False  # forward_near ran since the last spill_near
        self._loaded = {"forward": self.method}  # each method loaded once, on its first call
        eos = self._meta("get_eos_ids", [])
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.bos_id = self._meta("get_bos_id", None)

    def _meta(self, name: str, default):
        if name not in self.program.method_names:
            return default
        out = self.program.load_method(name).execute([])
        vals = [v.item() if hasattr(v, "item") else v for v in out]
        return vals[0] if len(vals) == 1 and name != "get_eos_ids" else vals

    def _method(self, name: str):
        if name not in self._loaded:
            self._loaded[name] = self.program.load_method(name)
        return self._loaded[name]

    def forward(self, tokens: list[int], pos: int):
        """Logits ``[vocab]`` after ``tokens`` placed at positions ``pos ..`` (the KV cache keeps the rest)."""
        import torch

        if pos + len(tokens) > self.max_seq_len or len(tokens) > self.max_seq_len - 1:
            raise SpinQuantError(
                f"{pos + len(tokens)} tokens exceed the program's context of {self.max_seq_len}; "
                "shorten the prompt or re-export with a larger --max-seq-len"
            )
        where = torch.arange(pos, pos + len(tokens)) if self.positions_per_token else torch.tensor([pos])
        inputs = [torch.tensor([tokens], dtype=torch.long), where]
        name = choose_method(len(tokens), pos + len(tokens), self.max_seq_len, self.methods, self.near_len)
        if name == CTX_METHOD:  # attention over the filled context only; its length is the third input's
            inputs.append(torch.zeros(pos + len(tokens)))
        if name == NEAR_METHOD:
            self._near_unspilled = self.has_spill
        elif self._near_unspilled:
            self._method(SPILL_METHOD).execute([])
            self._near_unspilled = False
        logits = self._method(name).execute(inputs)[0]
        return logits.reshape(-1, logits.shape[-1])[-1]  # some programs return every position's logits


def generate(model: PteModel, prompt_ids: list[int], max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 0.9, seed: int = 0, on_token: Callable[[int], None] | None = None,
             stop_at_eos: bool = True, sampling: SamplingConfig | None = None) -> tuple[list[int], GenerationStats]:
    """Prefill the prompt in one call, then decode one token per call with the program's KV cache.
    ``sampling`` (top-k, min-p, repetition penalty: ``sampling.SamplingConfig``) replaces ``temperature``,
    ``top_p`` and ``seed`` when given."""
    if sampling is None:
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
    if not prompt_ids:
        raise SpinQuantError("the prompt is empty")
    if len(prompt_ids) >= model.max_seq_len:
        raise SpinQuantError(
            f"the prompt has {len(prompt_ids)} tokens but the program's context is {model.max_seq_len}; "
            "shorten it or re-export with a larger --max-seq-len"
        )
    max_new_tokens = min(max_new_tokens, model.max_seq_len - len(prompt_ids))
    rng = SplitMix64(sampling.seed)
    history = list(prompt_ids) if sampling.repeat_penalty != 1.0 else None  # what the penalty looks back on
    t0 = time.perf_counter()
    logits = model.forward(prompt_ids, 0)
    t_prefill = time.perf_counter() - t0
    out: list[int] = []
    token = sample_token(logits, sampling, rng, history or ())
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    pos = len(prompt_ids)
    while True:
        out.append(token)
        if history is not None:
            history.append(token)
        if on_token:
            on_token(token)
        if len(out) >= max_new_tokens or (stop_at_eos and token in model.eos_ids):
            break
        logits = model.forward([token], pos)
        pos += 1
        token = sample_token(logits, sampling, rng, history or ())
    decode_s = time.perf_counter() - t1
    return out, GenerationStats(len(prompt_ids), len(out), ttft, t_prefill, decode_s)


def pte_token_stats(model: PteModel, windows, progress: bool = True, reference=None):
    """``eval.TokenStats`` of the program itself: each window fed one token at a time through its KV
    cache (the program returns the last position's logits), as a runner uses it; against the eager
    ``reference`` model on the same windows when given."""
    import torch
    from tqdm.auto import tqdm

    from .eval import TokenStats, window_logits

    seq_len = windows.shape[1]
    if seq_len > model.max_seq_len:
        raise SpinQuantError(f"--seq-len {seq_len} exceeds the program's context of {model.max_seq_len}")
    stats = TokenStats()
    bar = tqdm(total=windows.shape[0] * (seq_len - 1), desc="pte perplexity", disable=not progress)
    for window in windows:
        ids = window.tolist()
        logits = []
        for pos in range(seq_len - 1):
            logits.append(model.forward([ids[pos]], pos).float().clone())
            bar.update(1)
        ref = None
        if reference is not None:
            with torch.no_grad():
                ref = window_logits(reference, window[None])[0]
        stats.add(torch.stack(logits), window[1:], ref)
    bar.close()
    return stats


def pte_perplexity(model: PteModel, windows, progress: bool = True) -> float:
    """Perplexity of the program, token by token through its KV cache (see ``pte_token_stats``)."""
    return pte_token_stats(model, windows, progress).perplexity


class TextStreamer:
    """Decode token ids incrementally without ever printing half a UTF-8 character."""

    def __init__(self, tokenizer, write: Callable[[str], None]):
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            return
        self.write(text[self.printed:])
        self.printed = len(text)
