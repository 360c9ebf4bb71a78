"""Quality of an eager (fake-quant) model: perplexity on token windows, and zero-shot tasks through lm-eval."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm


@dataclass
class TokenStats:
    """Next-token statistics summed over windows: the model's NLL and, against a reference (the float
    model on the same tokens), the KL divergence and how often both pick the same top-1 token.

    Perplexity alone hides how often a quantized model picks another token; these are the statistics
    of llama.cpp's ``llama-perplexity --kl-divergence`` (mean KL(P_ref || P_model), "same top p")."""

    nll: float = 0.0
    tokens: int = 0
    ref_nll: float = 0.0
    kl: float = 0.0
    same_top1: int = 0
    compared: int = 0

    @torch.no_grad()
    def add(self, logits: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        """``logits [T, V]`` predicting ``targets [T]``; ``reference [T, V]``: the reference model's logits."""
        logp = torch.log_softmax(logits.float(), -1)
        self.nll -= logp.gather(-1, targets[:, None]).sum().item()
        self.tokens += targets.numel()
        if reference is None:
            return
        ref_logp = torch.log_softmax(reference.float(), -1)
        self.ref_nll -= ref_logp.gather(-1, targets[:, None]).sum().item()
        self.kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
        self.same_top1 += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
        self.compared += targets.numel()

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    def summary(self) -> dict[str, float]:
        """``perplexity`` and, when a reference was given, ``reference_perplexity``, ``ppl_ratio``,
        ``mean_kl`` (nats per token) and ``top1_agreement`` (fraction of tokens)."""
        out = {"perplexity": self.perplexity}
        if self.compared:
            ref_ppl = math.exp(self.ref_nll / self.compared)
            out.update(reference_perplexity=ref_ppl, ppl_ratio=self.perplexity / ref_ppl,
                       mean_kl=self.kl / self.compared, top1_agreement=self.same_top1 / self.compared)
        return out


def window_logits(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, L-1, V]`` predicting ``batch[:, 1:]`` from an eager HF model."""
    return model(batch, use_cache=False).logits[:, :-1]


@torch.no_grad()
def token_stats(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 1, progress: bool = True,
                reference: torch.nn.Module | None = None,
                reference_logits: list[torch.Tensor] | None = None) -> TokenStats:
    """``TokenStats`` of an eager model over every position of every window ``[N, L]``, against
    ``reference`` (an eager model run on the same windows) or its precomputed ``reference_logits``
    (one ``[L-1, V]`` tensor per window, from ``window_logits``) when given."""
    stats = TokenStats()
    for b, batch in enumerate(tqdm(windows.split(batch_size), desc="perplexity", disable=not progress)):
        if reference is not None:
            refs = window_logits(reference, batch)
        elif reference_logits is not None:
            refs = reference_logits[b * batch_size : b * batch_size + len(batch)]
        else:
            refs = [None] * len(batch)
        for logits, window, ref in zip(window_logits(model, batch), batch, refs, strict=True):
            stats.add(logits, window[1:], ref)
    return stats


def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 1, progress: bool = True) -> float:
    """``exp(mean NLL)`` of next-token prediction over every position of every window ``[N, L]``."""
    return token_stats(model, windows, batch_size, progress).perplexity


class LMEvalUnavailable(Exception):
    """lm-eval or a task's dataset cannot be had here; the message says why and what to do."""


def load_lm_eval_tasks(names: list[str], include_path: str | None = None) -> dict:
    """lm-eval's task objects for ``names``, datasets loaded (so a missing hub fails before any work).
    ``include_path``: a folder of extra task YAMLs (e.g. tasks over local JSON files, for offline use)."""
    try:
        from lm_eval.tasks import TaskManager, get_task_dict
    except ImportError:
        raise LMEvalUnavailable("lm-eval is not installed; `pip install lm-eval` adds it") from None
    try:
        return get_task_dict(names, TaskManager(include_path=include_path))
    except Exception as e:  # unknown task names, or datasets that neither the hub nor the local cache has
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise LMEvalUnavailable(
            f"lm-eval could not load {','.join(names)} ({type(e).__name__}: {reason}); its datasets come from the "
            "Hugging Face hub or its local cache (HF_DATASETS_CACHE), so run where either is reachable"
        ) from None


def lm_eval_scores(loaded, tasks: dict, limit: int | None = None, batch_size: int = 8) -> dict[str, dict[str, float]]:
    """Zero-shot ``{task: {metric: value}}`` (acc, acc_norm where the task has it) of ``loaded``'s model as
    it is (a fake-quant model is evaluated as it will run)."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=batch_size, device="cpu")
    results = evaluate(lm=lm, task_dict=tasks, limit=limit, verbosity="ERROR")["results"]
    return {task: {m.split(",")[0]: float(v) for m, v in metrics.items() if m.split(",")[0] in ("acc", "acc_norm")}
            for task, metrics in results.items()}


def lm_eval_table(scores: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: one row per model, one column per task/metric."""
    cols = sorted({(t, m) for per_task in scores.values() for t, ms in per_task.items() for m in ms})
    lines = ["| model | " + " | ".join(f"{t} {m}" for t, m in cols) + " |", "|---|" + "---|" * len(cols)]
    for name, per_task in scores.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{per_task[t][m]:.4f}" if m in per_task.get(t, {}) else "-" for t, m in cols) + " |")
    return "\n".join(lines)
