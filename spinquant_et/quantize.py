"""The ``quantize`` stage: fuse norms, rotate, quantize weights, install online pieces.

``quantize(loaded, recipe) -> QuantizedModel``. The model that comes back computes exactly what
the exported program will: its float weights are the dequantized integers, and activations /
KV are fake-quantized online. The integers themselves are kept in ``qtensors`` for the checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .models.load import LoadedModel, untie_embeddings
from .online import attach_recipe
from .quant.quantizer import dequantize_weight, quantize_weight
from .quant.rtn import rtn_quantize
from .recipe import NO_QUANT, QuantRecipe
from .rotation import fuse_norms, random_rotations, rotate_model

log = logging.getLogger(__name__)


@dataclass
class QuantizedModel:
    """A quantized model: the fake-quant HF module plus the integer tensors behind its weights."""

    loaded: LoadedModel
    recipe: QuantRecipe
    qtensors: dict[str, torch.Tensor] = field(default_factory=dict)  # "<name>.weight" int8, "<name>.scales" fp32

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds: the float state dict with quantized weights replaced by ints + scales."""
        tensors = {k: v.detach().contiguous() for k, v in self.loaded.model.state_dict().items()}
        tensors.update({k: v.contiguous() for k, v in self.qtensors.items()})
        return tensors


def linear_input_dims(loaded: LoadedModel) -> dict[str, int]:
    """``{module name: in_features}`` of every decoder-layer linear (what a group size must divide)."""
    arch = loaded.arch
    return {
        f"{arch.layers}.{i}.{name}": layer.get_submodule(name).in_features
        for i, layer in enumerate(loaded.model.get_submodule(arch.layers))
        for name in arch.linears
    }


def rotate(loaded: LoadedModel, recipe: QuantRecipe) -> None:
    """Untie, fuse norms and apply the recipe's offline rotations (R1, R2, R4's weight side) in place."""
    untie_embeddings(loaded.model)  # before anything: R1 must not hit a shared tensor twice
    fuse_norms(loaded.model, loaded.arch)
    if not recipe.rotated:
        return
    if recipe.rotation == "hadamard":
        r1, r2 = random_rotations(loaded.model.config, recipe.seed)
    else:
        from .rotation.io import load_rotations

        r1, r2 = load_rotations(recipe.rotation, loaded.model.config)
    rotate_model(loaded.model, loaded.arch, r1, r2, r4=True)


@torch.no_grad()
def quantize_weights(loaded: LoadedModel, recipe: QuantRecipe, progress: bool = True) -> dict[str, torch.Tensor]:
    """RTN(+clip) every decoder linear, int8 per-channel embeddings and lm_head; weights become dequantized floats."""
    arch, model = loaded.arch, loaded.model
    targets = [(n, recipe.w_bits, recipe.group_size, recipe.w_clip) for n in linear_input_dims(loaded)]
    targets += [(arch.embed, recipe.embedding_bits, -1, False), (arch.lm_head, recipe.lm_head_bits, -1, False)]
    qtensors: dict[str, torch.Tensor] = {}
    for name, bits, group_size, clip in tqdm(targets, desc="quantize weights", disable=not progress):
        if bits >= NO_QUANT:
            continue
        module = model.get_submodule(name)
        if clip:
            q, scales = rtn_quantize(module.weight, bits, group_size, clip=True)
        else:
            q, scales = quantize_weight(module.weight, bits, group_size)
        module.weight.data = dequantize_weight(q, scales).to(module.weight.dtype)
        qtensors[f"{name}.weight"], qtensors[f"{name}.scales"] = q, scales
    return qtensors


def quantize(loaded: LoadedModel, recipe: QuantRecipe, progress: bool = True) -> QuantizedModel:
    """Run the whole stage on ``loaded`` (modified in place) and return the quantized model."""
    recipe.check_dims(linear_input_dims(loaded))
    rotate(loaded, recipe)
    qtensors = quantize_weights(loaded, recipe, progress)
    attach_recipe(loaded.model, loaded.arch, recipe)
    loaded.recipe = recipe
    return QuantizedModel(loaded, recipe, qtensors)
