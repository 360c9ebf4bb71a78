"""Text for calibration and perplexity: a user's file, the built-in offline text, or wikitext-2.

The built-in text is CPython's own documentation (``pydoc_data.topics``, ~465k characters,
~113k SmolLM2 tokens): it ships with every Python, so tests and demos never need a network.
It is split by topic into a calibration part (``train``, first 70% of topics) and a held-out
part (``test``) so calibration never sees the evaluation tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .errors import SpinQuantError

log = logging.getLogger(__name__)

BUILTIN = "builtin"
WIKITEXT2 = "wikitext2"
TRAIN_FRACTION = 0.7


def builtin_text(split: str = "test") -> str:
    """The built-in offline corpus, ``train`` or ``test`` part."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    cut = int(len(keys) * TRAIN_FRACTION)
    chosen = keys[:cut] if split == "train" else keys[cut:]
    return "\n\n".join(topics[k] for k in chosen)


def wikitext2_text(split: str = "test") -> str:
    """wikitext-2-raw-v1 through ``datasets`` (needs the package and a reachable hub)."""
    try:
        from datasets import load_dataset

        data = load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
    except Exception as e:  # ImportError, or any of the hub's connection errors
        raise SpinQuantError(
            f"wikitext2 is not available ({type(e).__name__}); pip install datasets and connect to the hub, "
            "or pass --text-file / use the built-in text"
        ) from None
    return "\n\n".join(data["text"])


def check_text_source(source: str | Path | None) -> None:
    """A one-line error now, not after the model loads, for a text file that is not there."""
    if source is not None and str(source) not in (BUILTIN, WIKITEXT2) and not Path(source).is_file():
        raise SpinQuantError(f"text file not found: {source}; pass a UTF-8 text file, or leave the flag out for the "
                             "built-in text")


def load_text(source: str | Path | None = None, split: str = "test") -> str:
    """Text from ``source``: None or "builtin", "wikitext2", or a path to a UTF-8 file."""
    check_text_source(source)
    if source is None or str(source) == BUILTIN:
        return builtin_text(split)
    if str(source) == WIKITEXT2:
        return wikitext2_text(split)
    path = Path(source)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpinQuantError(f"{path} is not UTF-8 text; convert it (e.g. iconv -t utf-8)") from None


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """All token ids of ``text`` as one 1-D tensor (no special tokens)."""
    return torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)


def token_windows(ids: torch.Tensor, seq_len: int, n_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows ``[N, seq_len]`` from the start of ``ids`` (all of them if N is None)."""
    available = ids.numel() // seq_len
    if available < 1:
        raise SpinQuantError(
            f"the text has {ids.numel()} tokens, fewer than one window of {seq_len}; "
            "use a longer text or a smaller --seq-len"
        )
    if n_windows is not None and n_windows > available:
        log.warning("only %d windows of %d tokens in the text (asked for %d)", available, seq_len, n_windows)
    n = available if n_windows is None else min(n_windows, available)
    return ids[: n * seq_len].view(n, seq_len)


def calibration_samples(ids: torch.Tensor, seq_len: int, n_samples: int, seed: int = 0) -> torch.Tensor:
    """``n_samples`` windows ``[n, seq_len]`` at random offsets, reproducible from ``seed``."""
    if ids.numel() <= seq_len:
        raise SpinQuantError(
            f"the calibration text has {ids.numel()} tokens, not more than --seq-len {seq_len}; "
            "use a longer text or a smaller --seq-len"
        )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (n_samples,), generator=g)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


def calibration_windows(tokenizer, source: str | Path | None, seq_len: int, n_samples: int, seed: int = 0) -> torch.Tensor:
    """``calibration_samples`` of the calibration part of ``source`` (see ``load_text``), tokenized."""
    return calibration_samples(tokenize(tokenizer, load_text(source, "train")), seq_len, n_samples, seed)
