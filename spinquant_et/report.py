"""Pictures of what rotation does: outliers per layer, perplexity by method, the optimize loss curve.

``spinquant-et report --model M [--learned R.bin] [--quality results.json] [--loss R.bin.loss.json]
--out-dir report`` writes PNGs (matplotlib, Agg backend, no display needed).

Outliers: for every decoder linear, the input it really multiplies (after R4 for down_proj) is
collected on a few calibration windows; per input channel we take max |x| over tokens, and the
layer's outlier ratio is ``max over channels / median over channels``. A 4-bit per-token quantizer
spends its range on the largest channel, so this ratio is roughly how many quantization levels the
median channel loses; rotation spreads outliers over all channels and drives it toward 1.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .models.load import LoadedModel

GROUPS = {"q/k/v input": "q", "o_proj input": "o", "gate/up input": "gate", "down_proj input": "down"}


@torch.no_grad()
def outlier_ratios(loaded: LoadedModel, windows: torch.Tensor) -> dict[str, list[float]]:
    """``{group: [max/median channel magnitude per layer]}`` of decoder linear inputs (float model)."""
    arch = loaded.arch
    layers = loaded.model.get_submodule(arch.layers)
    amax: dict[tuple[str, int], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        for group, attr in GROUPS.items():
            module = layer.get_submodule(getattr(arch, attr))

            def hook(mod, inp, out, key=(group, i)):
                x = mod.effective_input(inp[0]) if hasattr(mod, "effective_input") else inp[0]
                m = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
                amax[key] = torch.maximum(amax[key], m) if key in amax else m

            hooks.append(module.register_forward_hook(hook))
    try:
        for w in windows:
            loaded.model(w[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {g: [(amax[(g, i)].max() / amax[(g, i)].median().clamp_min(1e-12)).item() for i in range(len(layers))]
            for g in GROUPS}


def rotated_copy(base: LoadedModel, rotation: str) -> LoadedModel:
    """A float copy with norms fused and ``rotation`` applied (R4 online), nothing quantized."""
    from .online import attach_recipe
    from .quantize import rotate
    from .recipe import NO_QUANT, QuantRecipe

    loaded = copy.deepcopy(base)
    recipe = QuantRecipe(rotation=rotation, w_bits=NO_QUANT, a_bits=NO_QUANT, embedding_bits=NO_QUANT,
                         lm_head_bits=NO_QUANT)
    rotate(loaded, recipe)
    attach_recipe(loaded.model, loaded.arch, recipe)
    return loaded


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_outliers(ratios: dict[str, dict[str, list[float]]], out: Path, title: str) -> Path:
    """One panel per linear-input group; a line per rotation; log scale."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(GROUPS), figsize=(4.2 * len(GROUPS), 3.6), sharey=True)
    for ax, group in zip(axes, GROUPS, strict=True):
        for label, by_group in ratios.items():
            ax.plot(range(len(by_group[group])), by_group[group], marker=".", label=label)
        ax.set_yscale("log")
        ax.set_title(group)
        ax.set_xlabel("layer")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("max / median channel |x|")
    axes[-1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_quality(results: dict, out: Path) -> Path:
    """Grouped bars: perplexity per recipe (rows) and method (columns), FP as a dashed line."""
    plt = _plt()
    rows, cols = results["rows"], results["columns"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(cols)
    for j, col in enumerate(cols):
        values = [results["ppl"][r][col] for r in rows]
        bars = ax.bar([i + j * width for i in range(len(rows))], values, width, label=col)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.axhline(results["fp"], color="k", linestyle="--", linewidth=1, label=f"FP {results['fp']:.2f}")
    ax.set_xticks([i + width * (len(cols) - 1) / 2 for i in range(len(rows))], rows)
    ax.set_yscale("log")
    ax.set_ylabel("perplexity (log)")
    ax.set_title(results.get("title", "perplexity by method"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_loss(data: dict, out: Path) -> Path:
    """loss.png from the contents of an ``R.bin.loss.json``."""
    plt = _plt()
    loss = data["loss"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(range(1, len(loss) + 1), loss, alpha=0.35, label="per step")
    k = max(1, len(loss) // 10)
    smooth = [sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
    ax.plot(range(1, len(loss) + 1), smooth, label=f"mean of {k}")
    cfg = data.get("config", {})
    loss_name = {"kl": "KL to the float model (nats/token)"}.get(cfg.get("loss", "ce"), "cross-entropy")
    ax.set_title(f"optimize: W{cfg.get('w_bits')}A{cfg.get('a_bits')}KV{cfg.get('kv_bits')}, lr {cfg.get('lr')}, "
                 f"batch {cfg.get('batch_size')}")
    ax.set_xlabel("step")
    ax.set_ylabel(loss_name)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
