"""R.bin: learned rotations in the reference SpinQuant format.

A ``torch.save``d dict: ``"R1"`` ``[hidden, hidden]`` and ``"model.layers.{i}.self_attn.R2"``
``[head_dim, head_dim]`` per layer. Loaded with ``weights_only=True`` (a checkpoint never runs code).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import SpinQuantError

ORTHOGONALITY_TOL = 1e-4


def r2_key(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.R2"


def _check_orthogonal(name: str, r: torch.Tensor, n: int) -> torch.Tensor:
    if not isinstance(r, torch.Tensor):
        raise SpinQuantError(f"R.bin: {name} is a {type(r).__name__}, not a tensor; expected the SpinQuant R.bin format")
    if tuple(r.shape) != (n, n):
        raise SpinQuantError(f"R.bin: {name} has shape {tuple(r.shape)}, expected ({n}, {n}) for this model")
    r = r.double()
    err = (r.T @ r - torch.eye(n, dtype=torch.float64)).abs().max().item()
    if err > ORTHOGONALITY_TOL:
        raise SpinQuantError(f"R.bin: {name} is not orthogonal (max |R^T R - I| = {err:.2e}); it is not a rotation")
    return r


def load_rotations(path: str | Path, config) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(R1, [R2 per layer])`` from an R.bin, checked against the model's shapes and for orthogonality."""
    from .apply import head_dim_of

    path = Path(path)
    if not path.is_file():
        raise SpinQuantError(f"rotation file not found: {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SpinQuantError(f"cannot read {path} as an R.bin ({type(e).__name__}); it may be corrupt") from None
    if not isinstance(data, dict) or "R1" not in data:
        raise SpinQuantError(f"{path} has no 'R1' entry; expected the SpinQuant R.bin format")
    r1 = _check_orthogonal("R1", data["R1"], config.hidden_size)
    hd = head_dim_of(config)
    r2 = []
    for i in range(config.num_hidden_layers):
        if r2_key(i) not in data:
            raise SpinQuantError(f"{path} has no {r2_key(i)}; expected one R2 per layer")
        r2.append(_check_orthogonal(r2_key(i), data[r2_key(i)], hd))
    return r1, r2


def save_rotations(path: str | Path, r1: torch.Tensor, r2: list[torch.Tensor]) -> None:
    """Write an R.bin the reference SpinQuant code can load (float32 tensors)."""
    from ..io import atomic_output_file

    data = {"R1": r1.detach().float().contiguous()}
    data.update({r2_key(i): r.detach().float().contiguous() for i, r in enumerate(r2)})
    with atomic_output_file(path, force=True) as tmp:
        torch.save(data, tmp)
