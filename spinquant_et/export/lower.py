"""torch.export -> XNNPACK (to_edge_transform_and_lower) -> ``.pte``, with the LLM runner's metadata methods.

Programs hold ``forward`` (any number of tokens, attention over the whole cache: what ExecuTorch's
stock runners call) and, for the portable ops, ``decode_<n>`` methods: one token, attention over the
cache's first ``n`` positions, every shape static. All methods share the KV-cache buffers and the
weights (stored once), so a runner prefills with ``forward`` and decodes each token with the smallest
``decode_<n>`` that holds the context so far: decode then costs what the filled context costs, not
``--max-seq-len``, and XNNPACK never re-plans a static graph.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..errors import SpinQuantError
from ..io import atomic_output_file
from ..runtime import DECODE_PREFIX
from .model import Transformer

log = logging.getLogger(__name__)


def metadata_methods(model: Transformer, bos_id: int | None, eos_ids: list[int]) -> dict:
    """Constant methods ExecuTorch's ``TextLLMRunner`` reads (``get_max_seq_len`` is required)."""
    a = model.args
    meta = {
        "get_max_seq_len": a.max_seq_len,
        "get_max_context_len": a.max_seq_len,
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": a.ops == "et-llama",
        "enable_dynamic_shape": True,
        "get_vocab_size": a.vocab_size,
        "get_n_layers": a.n_layers,
        "get_eos_ids": eos_ids,
    }
    if bos_id is not None:
        meta["get_bos_id"] = bos_id
    return meta


MIN_DECODE_WINDOW = 128
WINDOW_GROWTH = 4  # each lowered method costs export time (~ one more lowering); 4x keeps attention within 4x the context


def decode_windows(max_seq_len: int, ops: str = "portable") -> list[int]:
    """The default ``decode_<n>`` windows: 128, 512, 2048, ... below ``max_seq_len``, and
    ``max_seq_len`` itself (so every decode step runs a static graph). None for et-llama programs
    (their attention already stops at the current position)."""
    if ops != "portable":
        return []
    windows, n = [], MIN_DECODE_WINDOW
    while n < max_seq_len:
        windows.append(n)
        n *= WINDOW_GROWTH
    return windows + [max_seq_len]


def check_windows(windows: list[int], max_seq_len: int) -> list[int]:
    """``windows`` sorted and unique, each within ``1 .. max_seq_len`` (else a one-line error)."""
    windows = sorted(set(windows))
    if any(not 1 <= w <= max_seq_len for w in windows):
        raise SpinQuantError(f"--decode-windows must be in 1..{max_seq_len} (--max-seq-len), got "
                             f"{','.join(map(str, windows))}")
    return windows


def export_program(model: Transformer, window: int | None = None):
    """``torch.export`` of ``forward`` with a dynamic token count ``1 .. max_seq_len - 1`` or, with
    ``window``, of a one-token decode step attending to the cache's first ``window`` positions."""
    max_t = model.args.max_seq_len - 1
    pos = torch.tensor([0], dtype=torch.long)
    model.window = window
    try:
        with torch.no_grad():
            if window is not None:
                return torch.export.export(model, (torch.zeros(1, 1, dtype=torch.long), pos), strict=False)
            tokens = torch.zeros(1, min(4, max_t), dtype=torch.long)
            seq = torch.export.Dim("seq_len", min=1, max=max_t)
            return torch.export.export(model, (tokens, pos), dynamic_shapes=({1: seq}, None), strict=False)
    finally:
        model.window = None


def lower_to_pte(model: Transformer, out: str | Path, metadata: dict, force: bool = False,
                 windows: list[int] | None = None) -> dict[str, float]:
    """Export ``forward`` (+ a ``decode_<n>`` method per window), lower to XNNPACK and write ``out``
    atomically. Returns seconds per phase."""
    import executorch.kernels.quantized  # noqa: F401  (out-variants of the int8 KV cache's per-token ops)
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    windows = check_windows(windows or [], model.args.max_seq_len)

    times = {}
    with atomic_output_file(out, force) as tmp:
        t0 = time.perf_counter()
        programs = {"forward": export_program(model)}
        for w in windows:
            programs[f"{DECODE_PREFIX}{w}"] = export_program(model, w)
        times["export"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        edge = to_edge_transform_and_lower(
            programs,
            partitioner=[XnnpackPartitioner()],
            constant_methods=metadata,
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
        )
        times["lower"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        et_program = edge.to_executorch(ExecutorchBackendConfig(
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
            run_reinplace_pass=True,  # KV cache writes in place, not a copy of the whole cache per token
            # one KV cache for all methods: what forward writes, decode_<n> reads
            memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=bool(windows)),
            emit_mutable_buffer_names=bool(windows),
        ))
        tmp.write_bytes(et_program.buffer)
        times["serialize"] = time.perf_counter() - t0
    log.info("export %.1fs, lower %.1fs, serialize %.1fs", times["export"], times["lower"], times["serialize"])
    return times
