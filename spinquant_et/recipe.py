"""The quantization recipe: one typed, validated, JSON-serializable record of what was done.

It is written next to every quantized checkpoint (``recipe.json``) so ``eval`` and ``export``
rebuild exactly the same model (which online rotations, which activation/KV bits).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import SpinQuantError

ROTATIONS = ("none", "hadamard")
W_METHODS = ("rtn", "gptq")
GPTQ_TARGETS = ("float", "layer")
NO_QUANT = 16  # bits value meaning "keep float"


def check_clip_ratios(cfg) -> None:
    """``cfg.a_clip``, ``k_clip`` and ``v_clip`` in [0.5, 1.0] (a recipe, or optimize's config that trains for one)."""
    for name in ("a_clip", "k_clip", "v_clip"):
        if not 0.5 <= getattr(cfg, name) <= 1.0:
            raise SpinQuantError(f"--{name.replace('_', '-')} must be in [0.5, 1.0], got {getattr(cfg, name)}")


@dataclass
class QuantRecipe:
    """What to do to a float model. ``*_bits = 16`` keeps that tensor in float.

    rotation: "none", "hadamard" (random Hadamard R1/R2 + online Hadamard R3/R4), or a path to an
        ``R.bin`` with learned R1/R2 (R3/R4 are then the same fixed Hadamards).
    group_size: input channels per weight scale; -1 = one scale per output channel.
    """

    rotation: str = "hadamard"
    w_bits: int = 4
    group_size: int = 32
    w_method: str = "gptq"  # SmolLM2 W4A8 .pte: 1.017x FP perplexity, against RTN+clip's 1.61x (README)
    w_clip: bool = True
    a_bits: int = 8
    kv_bits: int = NO_QUANT
    embedding_bits: int = 8
    lm_head_bits: int = 8
    seed: int = 0
    act_order: bool = False  # GPTQ: visit columns by decreasing Hessian diagonal
    # GPTQ calibration windows (SmolLM2 W4A8 eager, float target: 64 -> 1.017x FP, 32 -> 1.033x; the
    # float target fits a least-squares map per layer and wants tokens per input channel) ...
    calib_samples: int = 64
    calib_seq_len: int = 512  # ... of this many tokens
    # GPTQ's target: "float", the float model's outputs (the error of earlier layers is corrected too;
    # SmolLM2 W4A8 1.033x FP against 1.050x); "layer", this layer's own float weights on its quantized inputs
    gptq_target: str = "float"
    # With the float target, lm_head's input map aimed at the float logits too (quantize.head_input_map).
    # SmolLM2 eager, same run: W4A4KV4 best recipe 1.416x -> 1.396x FP; W4A8 1.018x -> 1.020x (KL 0.040 ->
    # 0.039, top-1 89.4% -> 89.8%): it loses on perplexity at W4A8, so it is a flag, not the default.
    head_target: bool = False
    # Eager fake-quant only (XNNPACK's dynamic activation quantization takes each token's full range,
    # per token): clip ratios of activations and K/V, and o_proj's input quantized per head.
    a_clip: float = 1.0
    k_clip: float = 1.0
    v_clip: float = 1.0
    o_per_head: bool = False
    # GPTQ only, eager only: choose each linear input's clip ratio from ACT_CLIP_GRID by the output error
    # it adds on calibration text (quant.act_clip); the choices land in ``a_clips`` (linear name -> ratio)
    a_clip_search: bool = False
    a_clips: dict[str, float] = field(default_factory=dict)
    a_sym: bool = False  # symmetric activations and K/V (zero point 0), the reference's a_asym/k_asym/v_asym off

    def __post_init__(self):
        for name in ("w_bits", "a_bits", "kv_bits", "embedding_bits", "lm_head_bits"):
            bits = getattr(self, name)
            if not (2 <= bits <= 8 or bits == NO_QUANT):
                raise SpinQuantError(f"{name.replace('_', '-')} must be 2..8 or 16 (float), got {bits}")
        if self.group_size == 0 or self.group_size < -1:
            raise SpinQuantError(f"group size must be positive or -1 (per channel), got {self.group_size}")
        if self.calib_samples < 1 or self.calib_seq_len < 2:
            raise SpinQuantError(f"--calib-samples must be >= 1 and --calib-seq-len >= 2, got {self.calib_samples}, "
                                 f"{self.calib_seq_len}")
        check_clip_ratios(self)
        if self.a_clip_search and (self.w_method != "gptq" or self.w_bits >= NO_QUANT):
            raise SpinQuantError("--a-clip-search runs inside GPTQ's calibration: use it with --w-method gptq and "
                                 "--w-bits below 16")
        bad = {k: v for k, v in self.a_clips.items() if not (isinstance(v, (int, float)) and 0.5 <= v <= 1.0)}
        if bad:
            raise SpinQuantError(f"a_clips must hold ratios in [0.5, 1.0], got {next(iter(bad.items()))}")
        if self.gptq_target not in GPTQ_TARGETS:
            raise SpinQuantError(f"unknown GPTQ target {self.gptq_target!r}; choose one of {', '.join(GPTQ_TARGETS)}")
        if self.w_method not in W_METHODS:
            raise SpinQuantError(f"unknown weight method {self.w_method!r}; choose one of {', '.join(W_METHODS)}")
        if self.rotation not in ROTATIONS and not Path(self.rotation).suffix == ".bin":
            raise SpinQuantError(f"--rotation must be one of {', '.join(ROTATIONS)} or a path to an R.bin, got {self.rotation!r}")

    @property
    def rotated(self) -> bool:
        return self.rotation != "none"

    def check_dims(self, dims: dict[str, int]) -> None:
        """Fail early, naming the layer, if ``group_size`` does not divide an input dimension."""
        if self.w_bits >= NO_QUANT or self.group_size == -1:
            return
        for name, in_features in dims.items():
            if in_features % self.group_size:
                divisors = [g for g in (32, 64, 128, 256) if all(d % g == 0 for d in dims.values())]
                hint = f"e.g. {divisors[0]}" if divisors else "-1 (per channel)"
                raise SpinQuantError(
                    f"--group-size {self.group_size} does not divide in_features {in_features} of {name}; use {hint}"
                )

    def online_kwargs(self) -> dict:
        """The keyword arguments of ``online.attach_online`` beyond rotation and bits."""
        return dict(a_clip=self.a_clip, k_clip=self.k_clip, v_clip=self.v_clip, o_per_head=self.o_per_head,
                    a_clips=self.a_clips, a_sym=self.a_sym)

    def label(self) -> str:
        """Short name like ``W4A8KV16-hadamard`` for tables."""
        return f"W{self.w_bits}A{self.a_bits}KV{self.kv_bits}-{Path(self.rotation).name}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "QuantRecipe":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> "QuantRecipe":
        """A recipe from its JSON fields; fields of newer versions are ignored."""
        if not isinstance(data, dict):
            raise SpinQuantError(f"expected a JSON object, got {type(data).__name__}")
        data = {"gptq_target": "layer", **data}  # what GPTQ did before the field existed
        defaults = asdict(cls())
        for key, value in data.items():
            want = type(defaults.get(key))
            if key in defaults and not (isinstance(value, want) or (want is float and isinstance(value, int))):
                raise SpinQuantError(f"{key} must be {want.__name__}, got {value!r}")
        return cls(**{k: v for k, v in data.items() if k in defaults})
