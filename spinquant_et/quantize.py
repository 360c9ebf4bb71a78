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


def recipe_rotations(recipe: QuantRecipe, config) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """R1 and the per-layer R2 of a rotated recipe: the seed's random Hadamards, or its R.bin's."""
    if recipe.rotation == "hadamard":
        return random_rotations(config, recipe.seed)
    from .rotation.io import load_rotations

    return load_rotations(recipe.rotation, config)


def rotate(loaded: LoadedModel, recipe: QuantRecipe) -> None:
    """Untie, fuse norms and apply the recipe's offline rotations (R1, R2, R4's weight side) in place."""
    untie_embeddings(loaded.model)  # before anything: R1 must not hit a shared tensor twice
    fuse_norms(loaded.model, loaded.arch)
    if not recipe.rotated:
        return
    r1, r2 = recipe_rotations(recipe, loaded.model.config)
    rotate_model(loaded.model, loaded.arch, r1, r2, r4=True)


def _store(module: torch.nn.Module, name: str, q: torch.Tensor, scales: torch.Tensor, qtensors: dict) -> None:
    module.weight.data = dequantize_weight(q, scales).to(module.weight.dtype)
    qtensors[f"{name}.weight"], qtensors[f"{name}.scales"] = q, scales


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the activations it needs are collected."""


def _layer_inputs(loaded: LoadedModel, calibration: torch.Tensor) -> list[tuple[tuple, dict]]:
    """The ``(args, kwargs)`` the first decoder layer receives for each calibration window."""
    layers = loaded.model.get_submodule(loaded.arch.layers)
    captured: list[tuple[tuple, dict]] = []

    def catch(module, args, kwargs):
        if not args:  # hidden states passed by keyword: make them the first positional argument
            kwargs = dict(kwargs)
            args = (kwargs.pop("hidden_states"),)
        captured.append((args, kwargs))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for window in calibration:
            try:
                loaded.model(window[None], use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return captured


def _run_layer(layer, args, kwargs) -> torch.Tensor:
    out = layer(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _linear_inputs(layer, name: str, inputs, quantized: bool = True):
    """Yield, window by window, the ``[tokens, in]`` input that the linear ``name`` of ``layer``
    multiplies (``quantized=False``: before its activation quantizer); each pass stops as soon as
    ``name`` has its input (the rest of the layer is not needed)."""
    seen = []

    def collect(module, inp, out):
        x = module.effective_input(inp[0]) if quantized else module.transformed_input(inp[0])
        seen.append(x.detach().reshape(-1, module.in_features).float())
        raise _Stop

    hook = layer.get_submodule(name).register_forward_hook(collect)
    try:
        for args, kwargs in inputs:
            try:
                _run_layer(layer, args, kwargs)
            except _Stop:
                pass
            yield seen.pop()
    finally:
        hook.remove()


def _hessian(layer, name: str, inputs, float_layer=None, float_inputs=None):
    """``(H, C)``: the GPTQ Hessian of the linear ``name`` of ``layer`` over the calibration ``inputs``
    (it also serves the linears that read the same input: k/v beside q, up beside gate) and, given
    ``float_layer`` (the layer before quantization, quantizers off) and its ``float_inputs``, the cross
    term ``2/n sum x_float x^T`` over the same tokens (else None)."""
    from .quant.gptq import HessianAccumulator

    acc = HessianAccumulator(layer.get_submodule(name).in_features)
    if float_layer is None:
        for x in _linear_inputs(layer, name, inputs):
            acc.add(x)
        return acc.h, None
    cross = torch.zeros_like(acc.h)
    for x, x_float in zip(_linear_inputs(layer, name, inputs), _linear_inputs(float_layer, name, float_inputs),
                          strict=True):
        acc.add(x)
        cross += (x_float.T @ x).double()
    return acc.h, cross * (2 / acc.n)


def _float_copy(layer):
    """A copy of ``layer`` with activation/KV fake-quant off (the float model's layer, same rotations)."""
    import copy

    from .online import QuantLinear

    twin = copy.deepcopy(layer)
    for m in twin.modules():
        if isinstance(m, QuantLinear):
            m.a_bits = NO_QUANT
        if hasattr(m, "k_quant"):
            m.k_quant = m.v_quant = None
    return twin


@torch.no_grad()
def gptq_quantize_layers(loaded: LoadedModel, recipe: QuantRecipe, calibration: torch.Tensor,
                         progress: bool = True, before_layer=None, after_layer=None,
                         head_map=None) -> dict[str, torch.Tensor]:
    """GPTQ every decoder linear, layer by layer and, inside a layer, in dependency order (q/k/v, o,
    gate/up, down): each Hessian comes from inputs computed with everything before already quantized,
    activations fake-quantized and R3/R4 applied as at inference (``attach_recipe`` must have run).
    With ``recipe.gptq_target == "float"`` a float twin of each layer runs on the float model's inputs
    beside it, and GPTQ aims at the float outputs (``quant.gptq.float_target``). With
    ``recipe.a_clip_search`` each input's activation clip ratio is chosen (``quant.act_clip``) before
    its Hessian is built, and recorded in ``recipe.a_clips``.

    With the float target, lm_head is aimed at the float logits too: its input map ``M``
    (``head_input_map``) goes to ``head_map(M)``, by default ``lm_head.weight <- lm_head.weight @ M``
    (RTN quantizes it afterwards, as before).

    ``before_layer(i, layer)`` and ``after_layer(i, layer, qtensors)`` let a caller hold one layer at a
    time (``stream``): the first gives layer ``i`` its rotated weights, the second takes its integers
    (the returned dict then holds only what ``after_layer`` left in it)."""
    from .quant.act_clip import CLIP_WINDOWS, best_clip
    from .quant.gptq import float_target, gptq_quantize

    arch = loaded.arch
    layers = loaded.model.get_submodule(arch.layers)
    inputs = _layer_inputs(loaded, calibration)
    float_inputs = list(inputs) if recipe.gptq_target == "float" else None
    qtensors: dict[str, torch.Tensor] = {}
    steps = ((arch.q, arch.k, arch.v), (arch.o,), (arch.gate, arch.up), (arch.down,))  # each: one shared input
    for i, layer in enumerate(tqdm(layers, desc="GPTQ layers", disable=not progress)):
        if before_layer is not None:
            before_layer(i, layer)
        float_layer = _float_copy(layer) if float_inputs is not None else None
        for names in steps:
            if recipe.a_clip_search and recipe.a_bits < NO_QUANT:
                linears = [layer.get_submodule(n) for n in names]
                clip = best_clip(_linear_inputs(layer, names[0], inputs[:CLIP_WINDOWS], quantized=False), linears)
                for n, m in zip(names, linears, strict=True):
                    m.a_clip = recipe.a_clips[f"{arch.layers}.{i}.{n}"] = clip
            h, cross = _hessian(layer, names[0], inputs, float_layer, float_inputs)
            for n in names:
                m = layer.get_submodule(n)
                w = m.weight if cross is None else float_target(m.weight, h, cross)
                q, scales = gptq_quantize(w, h, recipe.w_bits, recipe.group_size, clip=recipe.w_clip,
                                          act_order=recipe.act_order)
                _store(m, f"{arch.layers}.{i}.{n}", q, scales, qtensors)
        inputs = [((_run_layer(layer, args, kwargs), *args[1:]), kwargs) for args, kwargs in inputs]
        if float_inputs is not None:
            float_inputs = [((_run_layer(float_layer, args, kwargs), *args[1:]), kwargs) for args, kwargs in float_inputs]
        del float_layer
        if after_layer is not None:
            after_layer(i, layer, qtensors)
    if float_inputs is not None and recipe.head_target:
        m = head_input_map(loaded, inputs, float_inputs)
        if head_map is None:
            head = loaded.model.get_submodule(arch.lm_head)
            head.weight.data = (head.weight.double() @ m).to(head.weight.dtype)
        else:
            head_map(m)
    return qtensors


def head_input_map(loaded: LoadedModel, inputs, float_inputs, damp: float = 0.01) -> torch.Tensor:
    """``M [dim, dim]`` (float64) such that ``lm_head.weight @ M`` applied to the quantized model's last
    hidden states best matches the float logits: ``float_target`` with the final norm's outputs,
    ``W' = W (C + lambda I)(H + lambda I)^-1``, which does not depend on ``W``. The error the decoder
    leaves in the last hidden state (shrinkage and mixing by 4-bit noise) is partly linear, and this
    undoes that part; it costs one pass of the final norm over the calibration windows."""
    from .quant.gptq import HessianAccumulator

    norm = loaded.model.get_submodule(loaded.arch.final_norm)
    dim = norm.weight.shape[0]
    acc = HessianAccumulator(dim)
    cross = torch.zeros_like(acc.h)
    for (args, _), (float_args, _) in zip(inputs, float_inputs, strict=True):
        x, x_float = (norm(a[0]).reshape(-1, dim).float() for a in (args, float_args))
        acc.add(x)
        cross += (x_float.T @ x).double()
    h, c = acc.h, cross * (2 / acc.n)
    ridge = damp * torch.mean(torch.diag(h)) * torch.eye(dim, dtype=h.dtype)
    return torch.linalg.solve(h + ridge, (c + ridge).T).T  # (C + R)(H + R)^-1, H symmetric


def default_calibration(loaded: LoadedModel, recipe: QuantRecipe, text: str | None = None) -> torch.Tensor:
    """``[calib_samples, calib_seq_len]`` windows of the calibration text (default: built-in, train part)."""
    from .data import calibration_windows
    from .errors import SpinQuantError

    if loaded.tokenizer is None:
        raise SpinQuantError("GPTQ needs calibration text, and this model has no tokenizer; add tokenizer.json")
    return calibration_windows(loaded.tokenizer, text, recipe.calib_seq_len, recipe.calib_samples, recipe.seed)


def head_groups(recipe: QuantRecipe) -> tuple[int, bool]:
    """lm_head's (group size, clip search): int8 per row, or below 8 bits groupwise like the decoder
    linears (8da4w, as ExecuTorch's own 4-bit exports quantize the output layer)."""
    return (-1, False) if recipe.lm_head_bits >= 8 else (recipe.group_size, recipe.w_clip)


@torch.no_grad()
def quantize_weights(loaded: LoadedModel, recipe: QuantRecipe, progress: bool = True,
                     calibration: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Decoder linears by RTN(+clip) or GPTQ, int8 per-channel embeddings and lm_head; weights become
    their dequantized floats. GPTQ needs ``calibration`` token windows and the online parts attached."""
    arch, model = loaded.arch, loaded.model
    qtensors: dict[str, torch.Tensor] = {}
    targets = []
    if recipe.w_bits < NO_QUANT and recipe.w_method == "gptq":
        qtensors.update(gptq_quantize_layers(loaded, recipe, calibration, progress))
    else:
        targets = [(n, recipe.w_bits, recipe.group_size, recipe.w_clip) for n in linear_input_dims(loaded)]
    targets += [(arch.embed, recipe.embedding_bits, -1, False), (arch.lm_head, recipe.lm_head_bits, *head_groups(recipe))]
    for name, bits, group_size, clip in tqdm(targets, desc="quantize weights", disable=not progress):
        if bits >= NO_QUANT:
            continue
        module = model.get_submodule(name)
        _store(module, name, *rtn_weight(module.weight, bits, group_size, clip), qtensors)
    return qtensors


def rtn_weight(w: torch.Tensor, bits: int, group_size: int, clip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` by round-to-nearest: with the clipping search, or max-abs scales."""
    return rtn_quantize(w, bits, group_size, clip=True) if clip else quantize_weight(w, bits, group_size)


def quantize(loaded: LoadedModel, recipe: QuantRecipe, progress: bool = True,
             calibration: torch.Tensor | None = None, calib_text: str | None = None) -> QuantizedModel:
    """Run the whole stage on ``loaded`` (modified in place) and return the quantized model.

    GPTQ calibrates on ``calibration`` windows if given, else on ``calib_text`` (default: built-in).
    """
    recipe.check_dims(linear_input_dims(loaded))
    rotate(loaded, recipe)
    attach_recipe(loaded.model, loaded.arch, recipe)  # GPTQ sees the inputs inference will see
    if recipe.w_method == "gptq" and recipe.w_bits < NO_QUANT and calibration is None:
        calibration = default_calibration(loaded, recipe, calib_text)
    qtensors = quantize_weights(loaded, recipe, progress, calibration)
    loaded.recipe = recipe
    return QuantizedModel(loaded, recipe, qtensors)
