"""The quantized checkpoint directory written by ``quantize`` and read by ``eval``/``export``.

Layout (HF names, so ``config.json`` rebuilds the module):
  model.safetensors   quantized linears/embeddings: ``<name>.weight`` int8 (values in the int-b
                      range) and ``<name>.scales`` fp32 ``[out, in / group_size]``; every other
                      tensor (fused norms = 1, biases) in float32 (a model quantized layer by
                      layer, ``spinquant_et.stream``, may write shards + ``model.safetensors.index.json``)
  config.json         the HF config (untied embeddings)
  recipe.json         the QuantRecipe (rotation, bits, group size, ...)
  tokenizer files     as ``tokenizer.save_pretrained`` writes them
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from .errors import SpinQuantError
from .io import atomic_output_dir, read_json
from .models.arch import arch_for
from .models.load import LoadedModel, _load_tokenizer
from .online import attach_recipe
from .quant.quantizer import dequantize_weight
from .quantize import QuantizedModel
from .recipe import QuantRecipe

WEIGHTS = "model.safetensors"
RECIPE = "recipe.json"


def save_quantized(qm: QuantizedModel, out: str | Path, force: bool = False) -> Path:
    """Write ``qm`` to ``out`` atomically (refuses an existing ``out`` unless ``force``)."""
    model = qm.loaded.model
    with atomic_output_dir(out, force) as tmp:
        save_file(qm.checkpoint_tensors(), str(tmp / WEIGHTS), metadata={"format": "pt", "spinquant_et": "1"})
        model.config.save_pretrained(tmp)
        qm.loaded.tokenizer.save_pretrained(tmp)
        (tmp / RECIPE).write_text(qm.recipe.to_json())
    return Path(out)


def read_recipe(path: Path) -> QuantRecipe:
    """The checkpoint's recipe.json, or a one-line error naming what is wrong with it."""
    data = read_json(path / RECIPE, "re-run quantize")
    try:
        return QuantRecipe.from_dict(data)
    except (TypeError, AttributeError, SpinQuantError) as e:
        raise SpinQuantError(f"{path / RECIPE} is not a recipe ({e}); re-run quantize") from None


def read_config(path: Path):
    """The checkpoint's HF config, or a one-line error."""
    from transformers import AutoConfig

    read_json(path / "config.json", "re-run quantize")  # a readable error before transformers' own
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a config it cannot use
        raise SpinQuantError(f"{path / 'config.json'} is not a usable model config ({type(e).__name__}); "
                             "re-run quantize") from None


def read_checkpoint(path: str | Path):
    """``(tensors, config, arch, recipe)`` of a checkpoint directory, tensors as stored (ints + scales).

    ``tensors`` reads each tensor when asked for (``shards.ShardTensors``), so building the Llama-3.1-8B
    shape's exportable model holds one layer of its 9 GB checkpoint at a time beside the model."""
    path = Path(path)
    recipe = read_recipe(path)
    config = read_config(path)
    arch = arch_for(config.model_type)
    from .shards import ShardReader, ShardTensors

    reader = ShardReader(path, "re-run quantize")
    reader.check()
    return ShardTensors(reader), config, arch, recipe


def load_quantized(path: str | Path) -> LoadedModel:
    """Rebuild the fake-quant model of a checkpoint directory (weights dequantized, online parts attached)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tensors, config, arch, recipe = read_checkpoint(path)
    state = {k: v for k, v in tensors.items() if not k.endswith(".scales")}
    for key, scales in tensors.items():
        if key.endswith(".scales"):
            weight_key = key[: -len(".scales")] + ".weight"
            if weight_key not in tensors:
                raise SpinQuantError(f"{path / WEIGHTS} has {key} but no {weight_key}; re-run quantize")
            state[weight_key] = dequantize_weight(tensors[weight_key], scales)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise SpinQuantError(f"{path} is missing tensors: {', '.join(missing[:3])}{more}; re-run quantize")
    model.load_state_dict({k: state[k] for k in expected}, strict=True)
    model.eval().requires_grad_(False)
    attach_recipe(model, arch, recipe)
    return LoadedModel(model=model, tokenizer=_load_tokenizer(str(path)), arch=arch, source=str(path), recipe=recipe)
