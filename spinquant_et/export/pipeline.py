"""The ``export`` stage: (model | quantized checkpoint) -> ``.pte`` + tokenizer files beside it."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from ..chat import CHAT_FILE, ChatTemplate
from ..errors import SpinQuantError
from ..io import usual_mode
from ..recipe import QuantRecipe
from .build import NEAR_LEN, build_transformer, check_exportable, check_ops
from .lower import lower_to_pte, metadata_methods, program_methods

log = logging.getLogger(__name__)



@dataclass
class ExportResult:
    pte: Path
    tokenizer: Path
    recipe: QuantRecipe
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def size_bytes(self) -> int:
        return self.pte.stat().st_size


def _load_checkpoint_dir(path: Path):
    from ..checkpoint import read_checkpoint
    from ..models.load import _load_tokenizer

    tensors, config, arch, recipe = read_checkpoint(path)
    check_exportable(recipe)
    return tensors, config, arch, recipe, _load_tokenizer(str(path))


def eos_ids(tokenizer, config) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    cfg_eos = getattr(config, "eos_token_id", None)
    ids |= set(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos] if cfg_eos is not None else [])
    return sorted(ids)


# What export writes beside X.pte (the tokenizer's share is what save_pretrained writes, kept if present):
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "tokenizer.model", CHAT_FILE)


def export_outputs(out: Path) -> list[Path]:
    """Every file ``export`` may write for ``out``: the .pte, ``<stem>.recipe.json`` and the tokenizer
    files (shared by every .pte in that folder)."""
    return [out, out.parent / f"{out.stem}.recipe.json", *(out.parent / name for name in TOKENIZER_FILES)]


def refuse_existing_outputs(out: Path, force: bool) -> None:
    """A one-line error before any work if ``export`` would overwrite a file and ``force`` is off."""
    existing = [p.name for p in export_outputs(out) if p.exists()]
    if existing and not force:
        raise SpinQuantError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''} in "
                             f"{out.parent}; pass --force to overwrite (export writes the .pte, its .recipe.json and "
                             "the tokenizer files beside it), or choose another folder")


def stage_tokenizer(tokenizer, directory: Path) -> None:
    """Write the tokenizer files ``export`` ships into ``directory``: tokenizer.json (+ its config and
    chat template as ``save_pretrained`` writes them) and chat.json for runners without Jinja."""
    tokenizer.save_pretrained(directory)
    for f in directory.iterdir():
        if f.name not in TOKENIZER_FILES:
            f.unlink()
    if not (directory / "tokenizer.json").is_file():
        raise SpinQuantError("the tokenizer has no tokenizer.json form (a slow tokenizer?); ExecuTorch's runners need one")
    chat = ChatTemplate.from_tokenizer(tokenizer)
    if chat:
        chat.write(directory / CHAT_FILE)


def export(model: str, recipe: QuantRecipe | None, out: str | Path, max_seq_len: int | None = None,
           force: bool = False, ops: str = "portable", calib_text: str | None = None,
           ctx_method: bool = True) -> ExportResult:
    """Quantize ``model`` with ``recipe`` (or take a quantized checkpoint as it is) and lower it to ``out``,
    with ``forward_ctx`` and ``forward_near`` beside ``forward`` when ``ctx_method`` and the ops are portable
    (see ``lower``; et-llama attention already stops at the current position)."""
    out = Path(out)
    refuse_existing_outputs(out, force)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    path = Path(model)
    from ..stream import can_stream

    # a streamed checkpoint's staging directory lives until the model is built: its tensors are read then
    with ExitStack() as scope:
        if path.is_dir() and (path / "recipe.json").is_file():
            tensors, config, arch, recipe, tokenizer = _load_checkpoint_dir(path)
        else:
            recipe = recipe or QuantRecipe()
            check_exportable(recipe)  # before minutes of quantization
            check_ops(ops, recipe)
            if can_stream(path):  # an HF safetensors directory: quantized one decoder layer at a time
                from ..stream import quantize_streaming

                out.parent.mkdir(parents=True, exist_ok=True)
                staging = Path(scope.enter_context(
                    tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.stem}.checkpoint.")))
                ckpt = quantize_streaming(path, recipe, staging / "checkpoint", calib_text=calib_text)
                tensors, config, arch, recipe, tokenizer = _load_checkpoint_dir(ckpt)
            else:
                from ..models import load_model
                from ..quantize import quantize

                loaded = load_model(model)
                seconds["load"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                qm = quantize(loaded, recipe, calib_text=calib_text)
                tensors, config, arch = qm.checkpoint_tensors(), loaded.model.config, loaded.arch
                tokenizer = loaded.tokenizer
        seconds["quantize"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ctx_method = ctx_method and ops == "portable"
        transformer = build_transformer(tensors, config, arch, recipe, max_seq_len, ops, NEAR_LEN if ctx_method else 0)
        seconds["build"] = time.perf_counter() - t0
    # The transformer holds its own (stacked) copies: let an in-memory checkpoint and any float model go
    # before lowering (a checkpoint directory is read tensor by tensor and never held whole). Lowering then
    # frees each linear's integers once XNNPACK has packed them (``release_weights``), so the peak is about
    # the built model (Llama-3.1-8B shape: 9.7 GB of int8 weights, scales, embeddings and KV cache).
    del tensors
    loaded = qm = None  # noqa: F841
    bos = tokenizer.bos_token_id
    meta = metadata_methods(transformer, bos, eos_ids(tokenizer, config))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.stem}.files.") as staging:
        staging = Path(staging)
        stage_tokenizer(tokenizer, staging)  # before the long lowering: a tokenizer problem fails fast
        sidecar = {**json.loads(recipe.to_json()), "max_seq_len": transformer.args.max_seq_len, "ops": ops,
                   "methods": program_methods(transformer, ctx_method)}
        (staging / f"{out.stem}.recipe.json").write_text(json.dumps(sidecar, indent=2))
        seconds.update(lower_to_pte(transformer, out, meta, force, ctx_method, release_weights=True))
        written = {f.name for f in staging.iterdir()}
        for f in staging.iterdir():
            usual_mode(f)
            f.replace(out.parent / f.name)
    for stale in export_outputs(out)[2:]:  # with --force: a previous tokenizer's files this one lacks
        if stale.name not in written and stale.exists():
            stale.unlink()
    return ExportResult(out, out.parent / "tokenizer.json", recipe, seconds)
