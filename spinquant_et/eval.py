"""Quality of an eager (fake-quant) model: perplexity on token windows, and zero-shot tasks through lm-eval."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 1, progress: bool = True) -> float:
    """``exp(mean NLL)`` of next-token prediction over every position of every window ``[N, L]``."""
    total_nll, total_tokens = 0.0, 0
    batches = windows.split(batch_size)
    for batch in tqdm(batches, desc="perplexity", disable=not progress):
        logits = model(batch, use_cache=False).logits[:, :-1].float()
        targets = batch[:, 1:]
        total_nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
        total_tokens += targets.numel()
    return math.exp(total_nll / total_tokens)


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
