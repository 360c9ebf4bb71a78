"""Perplexity of an eager (fake-quant) model on non-overlapping token windows."""

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
