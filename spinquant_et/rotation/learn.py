"""Learn R1 and the per-layer R2 (SpinQuant): Cayley SGD on the Stiefel manifold.

The model's weights stay frozen; R1 ``[hidden, hidden]`` and one R2 ``[head_dim, head_dim]`` per
layer are the only parameters. Each step rebuilds the rotated decoder weights from them
(``rotated_layer_tensors``, differentiable), runs the fake-quantized model (weights RTN with
clipping when ``w_bits < 16``, per-token activations on every linear input but lm_head, K after
R3 and V per token and head, all with straight-through estimators, R3/R4 online as at inference)
and minimizes the KL divergence from the float model (or next-token cross-entropy). Embeddings
and lm_head are not re-rotated as matrices: ``E[ids] R1`` and ``lm_head(h R1^T)`` compute the
same thing on the few rows a batch touches (the final RMSNorm is fused, so it commutes with R1).

Cayley SGD keeps each matrix exactly orthogonal: with the Euclidean gradient G of X, the skew
matrix ``W = (G X^T - X G^T) / 2`` gives the curve ``Y(a) = (I + a/2 W)^-1 (I - a/2 W) X`` whose
slope at 0 is half the negative Riemannian gradient, and the step is ``min(lr, 1 / ||W||_1)``: the
reference's SGDG exactly (Li et al. 2020, used by SpinQuant with lr 1.5, 100 steps, cosine schedule,
gradients clipped to norm 1 by the HF Trainer).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import SpinQuantError
from ..models.load import LoadedModel, untie_embeddings
from ..online import QuantLinear, attach_online
from ..quant.quantizer import fake_quant_weight_ste
from ..quant.rtn import clip_scales
from ..recipe import NO_QUANT, check_clip_ratios
from .apply import apply_r4_weights, head_dim_of, random_rotations, rotated_layer_tensors
from .fuse import fuse_norms
from .io import save_rotations

log = logging.getLogger(__name__)


class CayleySGD(torch.optim.Optimizer):
    """SGD on orthogonal matrices through the Cayley transform (square parameters only).

    As the reference's ``SGDG`` (SpinQuant ``train_utils/optimizer.py``, momentum 0): with the
    Euclidean gradient G of X, the skew matrix ``W = (G X^T - X G^T) / 2`` and the step
    ``min(lr, 1 / ||W||_1)`` (the largest column sum, which keeps the Cayley curve well inside its
    radius of convergence). The reference approximates the Cayley transform by 5 fixed-point
    iterations; we solve it exactly, so orthogonality holds to rounding.
    """

    def __init__(self, params, lr: float = 1.5, eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for x in group["params"]:
                if x.grad is None:
                    continue
                g, xd = x.grad.double(), x.double()
                a = (g @ xd.T - xd @ g.T) / 2
                alpha = min(group["lr"], 1.0 / (torch.linalg.matrix_norm(a, ord=1).item() + group["eps"]))
                eye = torch.eye(a.shape[0], dtype=torch.float64, device=a.device)
                y = torch.linalg.solve(eye + alpha / 2 * a, (eye - alpha / 2 * a) @ xd)
                x.copy_(y.to(x.dtype))
        return loss


LOSSES = ("ce", "kl")


@dataclass
class OptimizeConfig:
    """What ``optimize`` trains for and how.

    loss: "ce" = next-token cross-entropy on the calibration text (the reference); "kl" = KL divergence
        from the float model's next-token distribution (its logits under no_grad, one extra forward): the
        gradient then measures quantization damage only, not how well the text itself is predicted.
    grad_clip: the global gradient-norm limit over all rotations (the reference trains under the HF
        Trainer, whose ``max_grad_norm`` is 1.0); 0 = off.
    bf16: autocast matmuls to bfloat16 (on CUDA, and on CPUs with native bf16 such as AVX512-BF16 or AMX).
    clip_every: with ``w_bits < 16``, steps between searches of each weight group's clip ratio.
    a_clip, k_clip, v_clip, o_per_head: the eager activation/KV quantizers of the target recipe
        (``QuantRecipe``'s fields of the same names), so the rotation is trained for the quantizer it
        will be evaluated under.
    """

    a_bits: int = 4
    kv_bits: int = 4
    w_bits: int = NO_QUANT
    group_size: int = 32
    steps: int = 100
    lr: float = 1.5
    batch_size: int = 1
    seed: int = 0
    checkpoint_every: int = 10
    loss: str = "ce"
    grad_clip: float = 1.0
    bf16: bool = False
    clip_every: int = 10
    a_clip: float = 1.0
    k_clip: float = 1.0
    v_clip: float = 1.0
    o_per_head: bool = False

    def __post_init__(self):
        check_clip_ratios(self)
        if self.loss not in LOSSES:
            raise SpinQuantError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise SpinQuantError(f"--steps and --batch-size must be >= 1 and --lr > 0 (got {self.steps}, "
                                 f"{self.batch_size}, {self.lr})")


class _RotatedLayer(nn.Module):
    """A decoder layer run with rotated weights, under activation checkpointing: the backward pass
    recomputes the rotation and the layer, so memory holds one layer's activations, not all."""

    def __init__(self, layer: nn.Module, trainer: "RotationTrainer", index: int):
        super().__init__()
        self.layer, self.index = layer, index
        object.__setattr__(self, "trainer", trainer)  # not a submodule

    def forward(self, hidden_states, *args, **kwargs):
        from torch.func import functional_call
        from torch.utils.checkpoint import checkpoint

        def run(h):
            params = self.trainer.layer_params(self.index, self.layer)
            return functional_call(self.layer, params, (h, *args), kwargs, strict=False)

        return checkpoint(run, hidden_states, use_reentrant=False)


class RotationTrainer:
    """Holds the frozen fake-quant model, the trainable rotations and the optimizer state."""

    def __init__(self, loaded: LoadedModel, cfg: OptimizeConfig, device: str = "cpu"):
        self.loaded, self.cfg, self.arch = loaded, cfg, loaded.arch
        model = loaded.model
        untie_embeddings(model)
        fuse_norms(model, self.arch)
        apply_r4_weights(model, self.arch)
        attach_online(model, self.arch, rotated=True, a_bits=cfg.a_bits, kv_bits=cfg.kv_bits, a_clip=cfg.a_clip,
                      k_clip=cfg.k_clip, v_clip=cfg.v_clip, o_per_head=cfg.o_per_head)
        model.to(device).requires_grad_(False)
        model.train()  # Llama-family dropout is 0; train mode only lets the STEs pass gradients as usual
        self.model, self.device = model, device
        self.head_dim = head_dim_of(model.config)
        r1, r2 = random_rotations(model.config, cfg.seed)
        self.r1 = nn.Parameter(r1.float().to(device))
        self.r2 = nn.ParameterList([nn.Parameter(r.float().to(device)) for r in r2])
        self.optimizer = CayleySGD([self.r1, *self.r2], lr=cfg.lr)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=cfg.steps)
        self.step_done = 0
        self.losses: list[float] = []
        self.seconds, self.peak_rss_mib = 0.0, 0.0  # what the last optimize_rotations run spent
        self._float = False  # True while the float teacher runs (loss "kl")
        self._scales: dict[tuple[int, str], torch.Tensor] = {}  # this step's weight scales, reused by the recompute
        self._clip_ratios: dict[tuple[int, str], torch.Tensor] = {}  # per-group clip ratios, searched every clip_every
        self._clip_searched_at = -1  # the step whose search gave _clip_ratios
        model.get_submodule(self.arch.embed).register_forward_hook(lambda m, i, out: out @ self.r1)
        model.get_submodule(self.arch.lm_head).register_forward_pre_hook(lambda m, args: (args[0] @ self.r1.T,))
        layers = model.get_submodule(self.arch.layers)
        for i in range(len(layers)):
            layers[i] = _RotatedLayer(layers[i], self, i)

    def layer_params(self, i: int, layer: nn.Module) -> dict[str, torch.Tensor]:
        """Layer ``i``'s weights for the current rotations (fake-quantized when ``w_bits < 16``)."""
        params = {}
        for key, t in rotated_layer_tensors(layer, self.arch, self.r1, self.r2[i], self.head_dim).items():
            if self.cfg.w_bits < NO_QUANT and key.endswith(".weight") and not self._float:
                t = fake_quant_weight_ste(t, self.cfg.w_bits, self.cfg.group_size, scales=self._weight_scales(i, key, t))
            params[key] = t
        return params

    def _weight_scales(self, i: int, key: str, w: torch.Tensor) -> torch.Tensor:
        """RTN+clip scales of the rotated weight ``w`` (the deployed quantizer), without its full cost.

        The clipping search (80 ratios per group) on every weight every step would make a step 4x
        slower on CPU. Rotations move slowly, so each group's best clip *ratio* is searched every
        ``clip_every`` steps and applied to the current max-abs; the scales are computed once per
        step (the checkpointed backward recomputes with the same rotations and reuses them)."""
        scales = self._scales.get((i, key))
        if scales is not None:
            return scales
        w = w.detach().float()
        qmax = 2 ** (self.cfg.w_bits - 1) - 1
        amax = w.reshape(w.shape[0], -1, self.cfg.group_size).abs().amax(-1).clamp_min(1e-8)
        ratio = self._clip_ratios.get((i, key))
        if ratio is None:
            ratio = self._clip_ratios[(i, key)] = clip_scales(w, self.cfg.w_bits, self.cfg.group_size) * qmax / amax
        self._scales[(i, key)] = scales = ratio * amax / qmax
        return scales

    def _new_rotations(self) -> None:
        """Before a forward under rotations that may have changed: new weight scales, and at every
        ``clip_every``-th step a new clip-ratio search (done as the forward reaches each weight)."""
        self._scales.clear()
        if self.step_done % self.cfg.clip_every == 0 and self._clip_searched_at != self.step_done:
            self._clip_ratios.clear()
            self._clip_searched_at = self.step_done

    def _autocast(self):
        device_type = "cuda" if self.device.startswith("cuda") else "cpu"
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.cfg.bf16 or device_type == "cuda")

    @torch.no_grad()
    def _teacher_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The float model's logits (rotations leave them unchanged, so any R gives the same)."""
        quantizers = [(m, m.a_bits) for m in self.model.modules() if isinstance(m, QuantLinear)]
        kv = [(m, m.k_quant, m.v_quant) for m in self.model.modules() if hasattr(m, "k_quant")]
        self._float = True
        try:
            for m, _ in quantizers:
                m.a_bits = NO_QUANT
            for m, _, _ in kv:
                m.k_quant = m.v_quant = None
            with self._autocast():
                return self.model(ids, use_cache=False).logits.float()
        finally:
            self._float = False
            for m, bits in quantizers:
                m.a_bits = bits
            for m, k, v in kv:
                m.k_quant, m.v_quant = k, v

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """The training loss (``cfg.loss``) of the fake-quant model under the current rotations."""
        ids = ids.to(self.device)
        self._new_rotations()
        if self.cfg.loss == "kl":
            teacher = torch.log_softmax(self._teacher_logits(ids)[:, :-1], -1)
            with self._autocast():
                logits = self.model(ids, use_cache=False).logits
            student = torch.log_softmax(logits[:, :-1].float(), -1)
            return torch.nn.functional.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True,
                                              reduction="batchmean")
        with self._autocast():
            out = self.model(ids, labels=ids, use_cache=False)
        return out.loss.float()

    def batch(self, samples: torch.Tensor, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """This rank's share of step ``step``'s batch: a fixed function of (seed, step), so resuming and
        any number of processes see the same global batches."""
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        idx = torch.randint(0, samples.shape[0], (self.cfg.batch_size,), generator=g)
        return samples[idx[rank::world]]

    def train_step(self, samples: torch.Tensor, rank: int = 0, world: int = 1) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.batch(samples, self.step_done, rank, world))
        loss.backward()
        value = loss.detach()
        if world > 1:  # DDP's job done by hand: the parameters are a few small matrices
            import torch.distributed as dist

            for p in (self.r1, *self.r2):
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        if self.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_([self.r1, *self.r2], self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step_done += 1
        self.losses.append(value.item())
        return self.losses[-1]

    def rotations(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.r1.detach().cpu(), [r.detach().cpu() for r in self.r2]

    # --- checkpoints: tensors and numbers only, so they load with weights_only=True
    def state(self) -> dict:
        return {"step": self.step_done, "losses": torch.tensor(self.losses, dtype=torch.float64),
                "r1": self.r1.detach().cpu(), "r2": [r.detach().cpu() for r in self.r2],
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "config": asdict(self.cfg),
                "clip_ratios": {f"{i}|{key}": r for (i, key), r in self._clip_ratios.items()},
                "clip_searched_at": self._clip_searched_at}

    def load_state(self, state: dict) -> None:
        # a checkpoint older than a config field ran with that field's default
        saved = {**asdict(OptimizeConfig()), **state["config"]}
        if saved != asdict(self.cfg):
            changed = sorted(k for k in saved if saved[k] != asdict(self.cfg).get(k))
            raise SpinQuantError(f"--resume: the checkpoint was made with different settings ({', '.join(changed)}); "
                                 "use the same flags or drop --resume")
        with torch.no_grad():
            self.r1.copy_(state["r1"])
            for p, r in zip(self.r2, state["r2"], strict=True):
                p.copy_(r)
        self.optimizer.load_state_dict(state["optimizer"])  # holds the annealed learning rate
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_done = int(state["step"])
        self.losses = state["losses"].tolist()
        for name, ratio in state.get("clip_ratios", {}).items():  # so a resumed run clips as the straight one
            i, key = name.split("|", 1)
            self._clip_ratios[(int(i), key)] = ratio.to(self.device)
        self._clip_searched_at = int(state.get("clip_searched_at", -1))


def checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name + ".ckpt")


def orthogonality_error(r: torch.Tensor) -> float:
    r = r.double()
    return (r.T @ r - torch.eye(r.shape[0], dtype=torch.float64)).abs().max().item()


def optimize_rotations(loaded: LoadedModel, samples: torch.Tensor, out: str | Path, cfg: OptimizeConfig,
                       device: str = "cpu", resume: bool = False, progress: bool = True,
                       rank: int = 0, world: int = 1) -> RotationTrainer:
    """Train, checkpoint every ``cfg.checkpoint_every`` steps, write ``out`` (R.bin) and ``out.loss.json``."""
    out = Path(out)
    if cfg.batch_size % world:
        raise SpinQuantError(f"--batch-size {cfg.batch_size} must be a multiple of the {world} processes")
    trainer = RotationTrainer(loaded, cfg, device)
    ckpt = checkpoint_path(out)
    if resume:
        if not ckpt.is_file():
            raise SpinQuantError(f"--resume: no checkpoint {ckpt}; run without --resume to start")
        trainer.load_state(torch.load(ckpt, map_location="cpu", weights_only=True))
        log.info("resuming at step %d of %d", trainer.step_done, cfg.steps)
    t0, start_step = time.perf_counter(), trainer.step_done
    bar = tqdm(total=cfg.steps, initial=trainer.step_done, desc="optimize R1/R2", disable=not progress or rank > 0)
    while trainer.step_done < cfg.steps:
        loss = trainer.train_step(samples, rank, world)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{trainer.scheduler.get_last_lr()[0]:.3f}")
        if rank == 0 and cfg.checkpoint_every and trainer.step_done % cfg.checkpoint_every == 0:
            from ..io import atomic_output_file

            with atomic_output_file(ckpt, force=True) as tmp:
                torch.save(trainer.state(), tmp)
    bar.close()
    r1, r2 = trainer.rotations()
    worst = max(orthogonality_error(r) for r in (r1, *r2))
    if not math.isfinite(worst) or worst > 1e-4:
        raise SpinQuantError(f"the learned rotations drifted from orthogonal (max |R^T R - I| = {worst:.1e})")
    trainer.seconds = seconds = time.perf_counter() - t0
    if rank == 0:
        save_rotations(out, r1, r2)
        from ..sysinfo import peak_rss_mib

        trainer.peak_rss_mib = peak_mib = peak_rss_mib()
        steps_run = max(1, cfg.steps - start_step)
        out.with_name(out.name + ".loss.json").write_text(json.dumps(
            {"loss": trainer.losses, "config": asdict(cfg), "seconds": seconds, "seconds_per_step": seconds / steps_run,
             "peak_rss_mib": peak_mib, "max_orthogonality_error": worst}, indent=2))
    return trainer


__all__ = ["CayleySGD", "OptimizeConfig", "RotationTrainer", "optimize_rotations"]
