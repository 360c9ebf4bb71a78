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
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

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


class _Stages:
    """One progress line over the stages of lowering (each method: export, decompose, partition; then
    XNNPACK's preprocessing of all methods, the longest; then emit): ExecuTorch lowers every method in
    one call, so its stages are reported from inside it."""

    def __init__(self, total: int, progress: bool):
        self.bar = tqdm(total=total, desc="lower", unit="stage", disable=not progress,
                        bar_format="{desc}: {n}/{total} stages [{elapsed}] {postfix}")
        self.started = False
        self.done = threading.Event()
        if progress:  # the elapsed time keeps moving through a stage of minutes
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            self.bar.refresh()

    def start(self, label: str) -> None:
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_postfix_str(label)

    def close(self, finished: bool = True) -> None:
        self.done.set()
        if finished:
            self.bar.update(1)
        self.bar.close()


def _reporting_partitioner(method: str, stages: _Stages, last: bool):
    """An ``XnnpackPartitioner`` for one method that marks where ExecuTorch is in lowering it: it is
    asked which ops to keep (decomposition), then to partition; once the ``last`` method is
    partitioned, XNNPACK preprocesses every method's partitions."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    class Reporting(XnnpackPartitioner):
        decomposing = False

        def ops_to_not_decompose(self, ep):
            if not self.decomposing:
                self.decomposing = True
                stages.start(f"decompose {method}")
            return super().ops_to_not_decompose(ep)

        def partition(self, exported_program):
            stages.start(f"partition {method}")
            result = super().partition(exported_program)
            if last:
                stages.start("XNNPACK preprocess (all methods)")
            return result

    return Reporting()


def lower_to_pte(model: Transformer, out: str | Path, metadata: dict, force: bool = False,
                 windows: list[int] | None = None, progress: bool = True) -> dict[str, float]:
    """Export ``forward`` (+ a ``decode_<n>`` method per window), lower to XNNPACK and write ``out``
    atomically. Returns seconds per phase."""
    windows = check_windows(windows or [], model.args.max_seq_len)
    names = ["forward"] + [f"{DECODE_PREFIX}{w}" for w in windows]
    stages = _Stages(3 * len(names) + 2, progress)

    times = {}
    try:
        _lower(model, out, metadata, force, windows, names, stages, times)
    except BaseException:
        stages.close(finished=False)
        raise
    log.debug("export %.1fs, lower %.1fs, serialize %.1fs", times["export"], times["lower"], times["serialize"])
    return times


def _lower(model, out, metadata, force, windows, names, stages, times) -> None:
    import executorch.kernels.quantized  # noqa: F401  (out-variants of the int8 KV cache's per-token ops)
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    with atomic_output_file(out, force) as tmp:
        t0 = time.perf_counter()
        programs = {}
        for name, window in zip(names, [None, *windows], strict=True):
            stages.start(f"export {name}")
            programs[name] = export_program(model, window)
        times["export"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        edge = to_edge_transform_and_lower(
            programs,
            partitioner={name: [_reporting_partitioner(name, stages, name == names[-1])] for name in names},
            constant_methods=metadata,
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
        )
        times["lower"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        stages.start("emit and write")
        et_program = edge.to_executorch(ExecutorchBackendConfig(
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
            run_reinplace_pass=True,  # KV cache writes in place, not a copy of the whole cache per token
            # one KV cache for all methods: what forward writes, decode_<n> reads
            memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=bool(windows)),
            emit_mutable_buffer_names=bool(windows),
        ))
        tmp.write_bytes(et_program.buffer)
        times["serialize"] = time.perf_counter() - t0
        stages.close()
