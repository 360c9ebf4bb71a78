"""torch.export -> XNNPACK (to_edge_transform_and_lower) -> ``.pte``, with the LLM runner's metadata methods."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..io import atomic_output_file
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


def export_program(model: Transformer):
    """``torch.export`` with a dynamic token count ``1 .. max_seq_len - 1``."""
    max_t = model.args.max_seq_len - 1
    tokens = torch.zeros(1, min(4, max_t), dtype=torch.long)
    seq = torch.export.Dim("seq_len", min=1, max=max_t)
    with torch.no_grad():
        return torch.export.export(model, (tokens, torch.tensor([0], dtype=torch.long)),
                                   dynamic_shapes=({1: seq}, None), strict=False)


def lower_to_pte(model: Transformer, out: str | Path, metadata: dict, force: bool = False) -> dict[str, float]:
    """Export, lower to XNNPACK and write ``out`` atomically. Returns seconds per phase."""
    import executorch.kernels.quantized  # noqa: F401  (out-variants of the int8 KV cache's per-token ops)
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    times = {}
    with atomic_output_file(out, force) as tmp:
        t0 = time.perf_counter()
        program = export_program(model)
        times["export"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        edge = to_edge_transform_and_lower(
            program,
            partitioner=[XnnpackPartitioner()],
            constant_methods=metadata,
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
        )
        times["lower"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        et_program = edge.to_executorch(ExecutorchBackendConfig(
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
            run_reinplace_pass=True,  # KV cache writes in place, not a copy of the whole cache per token
        ))
        tmp.write_bytes(et_program.buffer)
        times["serialize"] = time.perf_counter() - t0
    log.info("export %.1fs, lower %.1fs, serialize %.1fs", times["export"], times["lower"], times["serialize"])
    return times
