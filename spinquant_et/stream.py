"""``quantize`` for models larger than memory: one decoder layer at a time, shards in, shards out.

The in-memory ``quantize`` holds the whole float model (an 8B model is 32 GB in fp32). Here the
model is a skeleton on the meta device; each decoder layer is read from the HF safetensors shards,
norm-fused, rotated (float64, that layer only), quantized (RTN+clip, or GPTQ through the same
``gptq_quantize_layers`` with the calibration activations carried from layer to layer), written
into the checkpoint's shards and released. The embedding table and lm_head are rotated and
quantized in blocks of rows. Peak memory is then about one layer in float64 plus one output shard
plus the int8 embedding table (and, for GPTQ, the calibration activations and the rotated float
embedding table while layer 0's inputs are computed), not the model.

The checkpoint is the in-memory path's (the same fusion, rotation and quantizer functions in the
same order and precision; tested tensor by tensor), so ``eval``, ``export`` and ``convert`` read it
as any other.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .models.arch import arch_for
from .models.load import LoadedModel, _load_tokenizer
from .online import attach_recipe
from .quantize import (
    _store,
    default_calibration,
    gptq_quantize_layers,
    head_groups,
    recipe_rotations,
    rtn_weight,
)
from .recipe import NO_QUANT, QuantRecipe
from .rotation.apply import apply_r4_layer, head_dim_of, rotate_layer, rotate_rows
from .rotation.fuse import fuse_layer_norms
from .shards import INDEX, SINGLE, ShardReader, ShardWriter

log = logging.getLogger(__name__)

ROW_BLOCK = 8192  # rows of the embedding table / lm_head rotated and quantized at once


def can_stream(spec: str | os.PathLike) -> bool:
    """Whether ``spec`` is an HF directory of safetensors weights (what this path reads)."""
    path = Path(spec)
    return path.is_dir() and (path / "config.json").is_file() and not (path / "recipe.json").is_file() \
        and ((path / SINGLE).is_file() or (path / INDEX).is_file())


def _skeleton(config, arch, recipe: QuantRecipe) -> nn.Module:
    """The untied model on the meta device with the recipe's online parts attached, and a real rotary
    embedding (its buffers are computed at construction, so the meta one holds none)."""
    from transformers import AutoModelForCausalLM

    config.tie_word_embeddings = False  # R1 goes into embeddings and lm_head on different sides
    if hasattr(config, "get_text_config"):
        config.get_text_config().tie_word_embeddings = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    inner = model.get_submodule(arch.layers.rpartition(".")[0])
    inner.rotary_emb = type(inner.rotary_emb)(config=model.config)
    model.eval().requires_grad_(False)
    attach_recipe(model, arch, recipe)
    return model


class _Streamer:
    """Moves one model's tensors from ``reader`` through rotation and quantization into ``writer``."""

    def __init__(self, reader: ShardReader, model: nn.Module, arch, recipe: QuantRecipe, writer: ShardWriter):
        self.reader, self.model, self.arch, self.recipe, self.writer = reader, model, arch, recipe, writer
        self.rotated = recipe.rotated
        if self.rotated:
            self.r1, self.r2 = recipe_rotations(recipe, model.config)
            from .hadamard import HadamardTransform

            self.h4 = HadamardTransform(model.config.intermediate_size).double()
        self.head_dim = head_dim_of(model.config)
        self.layers = model.get_submodule(arch.layers)
        self.head_map: torch.Tensor | None = None  # lm_head's input map, when GPTQ's float target made one

    def set_head_map(self, m: torch.Tensor) -> None:
        self.head_map = m

    # --- decoder layers
    def load_layer(self, i: int, layer: nn.Module) -> None:
        """Layer ``i``'s weights from the shards, norm-fused and rotated, as the in-memory path makes them."""
        prefix = f"{self.arch.layers}.{i}."
        state = {key: self.reader.get(prefix + key, torch.float32) for key in layer.state_dict()}
        layer.load_state_dict(state, strict=True, assign=True)
        layer.requires_grad_(False)
        fuse_layer_norms(layer, self.arch)
        if self.rotated:
            rotate_layer(layer, self.arch, self.r1, self.r2[i], self.head_dim)
            apply_r4_layer(layer, self.arch, self.h4)

    def write_layer(self, i: int, layer: nn.Module, qtensors: dict[str, torch.Tensor]) -> None:
        """Layer ``i``'s integers (taken out of ``qtensors``) and float tensors into the checkpoint; release it."""
        prefix = f"{self.arch.layers}.{i}."
        for key, t in layer.state_dict().items():
            name = prefix + key
            if name in qtensors:
                self.writer.add(name, qtensors.pop(name))
                self.writer.add(name[: -len(".weight")] + ".scales", qtensors.pop(name[: -len(".weight")] + ".scales"))
            else:
                self.writer.add(name, t)
        layer.to("meta")

    def rtn_layers(self, progress: bool) -> None:
        r = self.recipe
        for i, layer in enumerate(tqdm(self.layers, desc="quantize weights", unit="layer", disable=not progress)):
            self.load_layer(i, layer)
            qtensors: dict[str, torch.Tensor] = {}
            if r.w_bits < NO_QUANT:
                for name in self.arch.linears:
                    module = layer.get_submodule(name)
                    _store(module, f"{self.arch.layers}.{i}.{name}", *rtn_weight(module.weight, r.w_bits, r.group_size,
                                                                                  r.w_clip), qtensors)
            self.write_layer(i, layer, qtensors)

    # --- embeddings and lm_head, in blocks of rows
    def _rows(self, name: str) -> tuple[str, int]:
        """The stored tensor behind ``name``'s weight (lm_head falls back to the tied embeddings)."""
        key = f"{name}.weight"
        if key not in self.reader and name == self.arch.lm_head:
            key = f"{self.arch.embed}.weight"
        return key, self.reader.shape(key)[0]

    def rotated_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        key, _ = self._rows(name)
        w = self.reader.rows(key, start, stop, torch.float32)
        if name == self.arch.lm_head:  # the final RMSNorm fuses into lm_head (as rotation.fuse does)
            g = self.reader.get(f"{self.arch.final_norm}.weight", torch.float64)
            w = (w.double() * g[None, :]).to(torch.float32)
        w = rotate_rows(w, self.r1) if self.rotated else w
        if name == self.arch.lm_head and self.head_map is not None:
            w = (w.double() @ self.head_map).to(torch.float32)
        return w

    def rotated_table(self, name: str) -> torch.Tensor:
        """The whole rotated float table (GPTQ's calibration forward needs the embeddings)."""
        _, rows = self._rows(name)
        return torch.cat([self.rotated_rows(name, a, min(a + ROW_BLOCK, rows)) for a in range(0, rows, ROW_BLOCK)])

    def write_rows(self, name: str, bits: int, group_size: int, clip: bool) -> None:
        _, rows = self._rows(name)
        if bits >= NO_QUANT:
            self.writer.add(f"{name}.weight", self.rotated_table(name))
            return
        qs, scales = [], []
        for a in range(0, rows, ROW_BLOCK):
            q, s = rtn_weight(self.rotated_rows(name, a, min(a + ROW_BLOCK, rows)), bits, group_size, clip)
            qs.append(q)
            scales.append(s)
        self.writer.add(f"{name}.weight", torch.cat(qs))
        self.writer.add(f"{name}.scales", torch.cat(scales))

    def write_ends(self) -> None:
        """Embeddings, final norm (fused, so 1) and lm_head."""
        r, arch = self.recipe, self.arch
        self.write_rows(arch.embed, r.embedding_bits, -1, False)
        norm = self.reader.get(f"{arch.final_norm}.weight", torch.float32)
        self.writer.add(f"{arch.final_norm}.weight", torch.ones_like(norm))
        self.write_rows(arch.lm_head, r.lm_head_bits, *head_groups(r))


def quantize_streaming(model_dir: str | os.PathLike, recipe: QuantRecipe, out: str | os.PathLike, force: bool = False,
                       progress: bool = True, calib_text: str | None = None, shard_bytes: int = 2 << 30) -> Path:
    """Quantize the HF safetensors directory ``model_dir`` with ``recipe`` into the checkpoint directory
    ``out`` (written atomically), holding one decoder layer at a time."""
    from transformers import AutoConfig

    from .checkpoint import RECIPE
    from .io import atomic_output_dir
    from .models.load import config_input_dims

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    arch = arch_for(config.model_type)
    dims = config_input_dims(config)
    recipe.check_dims({f"{arch.layers}.{i}.{n}": d for i in range(config.num_hidden_layers) for n, d in dims.items()})
    reader = ShardReader(model_dir)
    tokenizer = _load_tokenizer(str(model_dir))
    model = _skeleton(config, arch, recipe)
    gptq = recipe.w_method == "gptq" and recipe.w_bits < NO_QUANT
    loaded = LoadedModel(model, tokenizer, arch, str(model_dir))
    calibration = default_calibration(loaded, recipe, calib_text) if gptq else None
    with atomic_output_dir(out, force) as tmp:
        with ShardWriter(tmp, shard_bytes, metadata={"spinquant_et": "1"}) as writer:
            streamer = _Streamer(reader, model, arch, recipe, writer)
            if gptq:
                embed, norm = model.get_submodule(arch.embed), model.get_submodule(arch.final_norm)
                embed.weight = nn.Parameter(streamer.rotated_table(arch.embed), requires_grad=False)
                norm.weight = nn.Parameter(torch.ones(norm.weight.shape), requires_grad=False)  # fused into lm_head
                gptq_quantize_layers(loaded, recipe, calibration, progress, before_layer=streamer.load_layer,
                                     after_layer=streamer.write_layer, head_map=streamer.set_head_map)
                embed.to("meta")
            else:
                streamer.rtn_layers(progress)
            streamer.write_ends()
        model.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / RECIPE).write_text(recipe.to_json())
    return Path(out)


__all__ = ["can_stream", "quantize_streaming"]
