"""torch.export -> XNNPACK (to_edge_transform_and_lower) -> ``.pte``, with the LLM runner's metadata methods.

Programs hold ``forward`` (any number of tokens, attention over the whole cache: what ExecuTorch's
stock runners call) and, for the portable ops:

* ``forward_ctx(tokens, input_pos, ctx)``: the same, but attention reads only the cache's first
  ``len(ctx)`` positions. The length comes from an input's shape, so torch.export makes it a backed
  dynamic size that XNNPACK delegates (derived from ``input_pos`` it would be unbacked, which XNNPACK's
  partitioner refuses). That window is a copy of those positions (ExecuTorch has no strided views);
* ``forward_near(token, input_pos)`` when the model has a near cache (``ExportArgs.near_len``): one
  decode step whose attention reads the near cache in place, a copy of the first ``near_len``
  positions that every method writes. Right while the filled context is at most ``near_len``. It
  writes the near cache alone; beside it, ``spill_near()`` copies the near cache into the cache, which
  runners call once before a method that reads the cache follows forward_near steps.

All methods share the KV-cache buffers and the weights (stored once); our runners pick the method per
call (``runtime.choose_method``), so a step costs what its context costs, not ``--max-seq-len``.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..io import atomic_output_file
from ..runtime import CTX_METHOD, NEAR_METHOD, SPILL_METHOD
from .model import NearSpill, Transformer

log = logging.getLogger(__name__)


def metadata_methods(model: Transformer, bos_id: int | None, eos_ids: list[int]) -> dict:
    """Constant methods ExecuTorch's ``TextLLMRunner`` reads (``get_max_seq_len`` is required)."""
    a = model.args
    meta = {
        "get_max_seq_len": a.max_seq_len,
        "get_near_len": a.near_len,  # forward_near's limit on the filled context (0: no forward_near)
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


def export_program(model: Transformer, method: str = "forward"):
    """``torch.export`` of ``forward`` with a dynamic token count ``1 .. max_seq_len - 1``; of
    ``forward_ctx``: the same plus a dynamic context length ``1 .. max_seq_len - 1`` (the length of a
    third input) that attention reads; of ``forward_near``: one token (static shapes), attending to the
    near cache; of ``spill_near``: no inputs (see ``NearSpill``)."""
    max_t = model.args.max_seq_len - 1
    tokens = torch.zeros(1, min(4, max_t), dtype=torch.long)
    pos = torch.tensor([0], dtype=torch.long)
    seq = torch.export.Dim("seq_len", min=1, max=max_t)
    with torch.no_grad():
        if method == SPILL_METHOD:
            return torch.export.export(NearSpill(model), (), strict=False)
        if method == NEAR_METHOD:
            model.near = True
            try:
                return torch.export.export(model, (tokens[:, :1], pos), strict=False)
            finally:
                model.near = False
        if method == "forward":
            return torch.export.export(model, (tokens, pos), dynamic_shapes=({1: seq}, None), strict=False)
        # The context may not reach max_seq_len: at that length the slice is the whole cache and
        # torch.export specializes it away; runners run the very last position through forward.
        length = torch.export.Dim("ctx_len", min=1, max=max_t)
        return torch.export.export(model, (tokens, pos, torch.zeros(min(8, max_t))),
                                   dynamic_shapes=({1: seq}, None, {0: length}), strict=False)


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


@contextmanager
def _xnnpack_without_copies(release: list[torch.Tensor] = ()):
    """ExecuTorch's XNNPACK lowering with copies of the weights left out, restored on exit.

    ``lower_all_submodules_to_backend`` deep-copies every partition of every method, weights included,
    before preprocessing any (``BackendDetails.copy_exported_program_for_preprocess``: "in case backends
    change graph"); and each method's preprocessing serializes its own copy of the packed weights, merged
    by hash only at emission. On the Llama-3.2-1B shape with three methods those were +4.1 GB and
    +2.2 GB over a 3 GB model. Here the copy shares the constant tensors (XNNPACK's passes replace
    constants, they never write into one; the graph is still copied), and each serialized blob is swapped
    for an identical one already kept, so one copy of each lives until emission.

    ``release``: tensors that only XNNPACK reads (the quantized linears' integers, scales, zero points).
    Partitions are then preprocessed in the order of the first of those they read (layer by layer across
    methods, not method by method), and each tensor's storage is freed once every partition reading it is
    preprocessed, so the int8 weights drain as their packed form fills in (the Llama-3.1-8B shape holds
    7 GB of them). The model that owns them cannot run afterwards. ExecuTorch offers no setting for any of
    this, hence the patch, scoped to one lowering.
    """
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    preprocess = XnnpackBackend.preprocess
    kept: dict[bytes, bytes] = {}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in release if t.numel()}
    rank = {ptr: i for i, ptr in enumerate(storages)}
    readers = dict.fromkeys(storages, 0)  # partitions yet to be preprocessed that read each storage
    reads: dict[int, list[int]] = {}  # id(partition) -> the released storages it reads

    def copy_sharing_constants(cls, edge_program, compile_specs):
        constants = [t for t in (*edge_program.state_dict.values(), *edge_program.constants.values())
                     if isinstance(t, torch.Tensor)]
        program = copy.deepcopy(edge_program, {id(t): t for t in constants})
        ptrs = {t.untyped_storage().data_ptr() for t in constants} & storages.keys()
        for ptr in ptrs:
            readers[ptr] += 1
        reads[id(program)] = list(ptrs)
        return program

    def preprocess_keeping_one_copy(edge_program, compile_specs):
        result = preprocess(edge_program, compile_specs)
        store = result.data_store_output
        if store is not None:
            store.buffers = [kept.setdefault(hashlib.sha256(b).digest(), b) if isinstance(b, bytes) else b
                             for b in store.buffers]
        return result

    def preprocess_releasing(cls, edge_programs, compile_specs):
        jobs = [(method, i) for method, programs in edge_programs.items() for i in range(len(programs))]
        jobs.sort(key=lambda job: min((rank[p] for p in reads.get(id(edge_programs[job[0]][job[1]]), ())),
                                      default=-1))
        results = {method: [None] * len(programs) for method, programs in edge_programs.items()}
        for method, i in jobs:
            program = edge_programs[method][i]
            results[method][i] = cls.preprocess(program, compile_specs[method][i])
            for ptr in reads.pop(id(program), ()):
                readers[ptr] -= 1
                if readers[ptr] == 0:
                    storages[ptr].resize_(0)
        return results

    patched = {"copy_exported_program_for_preprocess": classmethod(copy_sharing_constants),
               "preprocess": staticmethod(preprocess_keeping_one_copy),
               "preprocess_multimethod": classmethod(preprocess_releasing)}
    saved = {name: XnnpackBackend.__dict__.get(name) for name in patched}
    for name, value in patched.items():
        setattr(XnnpackBackend, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(XnnpackBackend, name)
            else:
                setattr(XnnpackBackend, name, value)


def _check_nothing_released_is_read(edge, names: list[str]) -> None:
    """A freed tensor still read outside XNNPACK would be emitted empty: stop before writing such a file."""
    for name in names:
        program = edge.exported_program(name)
        for key, t in (*program.state_dict.items(), *program.constants.items()):
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().nbytes() == 0:
                raise RuntimeError(f"{name} reads {key} outside XNNPACK, but its storage was freed after packing; "
                                   "export with release_weights=False")


def releasable_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The quantized linears' tensors, in module order: only their XNNPACK kernels read them."""
    from .model import Int8DynActInt4WeightLinear, Int8DynActInt8WeightLinear

    return [b for m in model.modules() if isinstance(m, (Int8DynActInt4WeightLinear, Int8DynActInt8WeightLinear))
            for b in m.buffers(recurse=False)]


def program_methods(model: Transformer, ctx_method: bool) -> list[str]:
    """The methods a program of ``model`` holds."""
    near = [NEAR_METHOD, SPILL_METHOD] if model.args.near_len else []
    return ["forward"] + ([CTX_METHOD] if ctx_method else []) + near


def lower_to_pte(model: Transformer, out: str | Path, metadata: dict, force: bool = False,
                 ctx_method: bool = False, progress: bool = True, release_weights: bool = False) -> dict[str, float]:
    """Export ``forward`` (and ``forward_ctx`` with ``ctx_method``; ``forward_near`` when the model has a
    near cache), lower to XNNPACK and write ``out`` atomically. Returns seconds per phase.
    ``release_weights``: free the quantized linears' tensors as XNNPACK packs them (peak memory: the
    model's int8 weights do not live beside their packed form); ``model`` cannot run afterwards."""
    names = program_methods(model, ctx_method)
    stages = _Stages(3 * len(names) + 2, progress)

    times = {}
    try:
        _lower(model, out, metadata, force, names, stages, times, release_weights)
    except BaseException:
        stages.close(finished=False)
        raise
    log.debug("export %.1fs, lower %.1fs, serialize %.1fs", times["export"], times["lower"], times["serialize"])
    return times


def _lower(model, out, metadata, force, names, stages, times, release_weights) -> None:
    import executorch.kernels.quantized  # noqa: F401  (out-variants of the int8 KV cache's per-token ops)
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    with atomic_output_file(out, force) as tmp:
        t0 = time.perf_counter()
        programs = {}
        for name in names:
            stages.start(f"export {name}")
            programs[name] = export_program(model, name)
        times["export"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with _xnnpack_without_copies(releasable_weights(model) if release_weights else []):
            edge = to_edge_transform_and_lower(
                programs,
                partitioner={name: [_reporting_partitioner(name, stages, name == names[-1])] for name in names},
                constant_methods=metadata,
                compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
            )
        if release_weights:
            _check_nothing_released_is_read(edge, names)
        times["lower"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        stages.start("emit and write")
        et_program = edge.to_executorch(ExecutorchBackendConfig(
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
            run_reinplace_pass=True,  # KV cache writes in place, not a copy of the whole cache per token
            # one KV cache for both methods: what either writes, the other reads
            memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=len(names) > 1),
            emit_mutable_buffer_names=len(names) > 1,
        ))
        with open(tmp, "wb") as f:  # streamed: `.buffer` would join the whole program into one more copy
            et_program.write_to_file(f)
        del et_program, edge
        times["serialize"] = time.perf_counter() - t0
        stages.close()
