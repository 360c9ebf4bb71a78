"""Safetensors weights one tensor at a time: read from a model's shards, write into new shards.

What lets ``quantize`` and ``make_model`` handle models larger than memory: a reader that loads
only the tensor (or the rows of it) asked for, and a writer that holds one shard at a time.

Layout, as transformers writes it: one ``model.safetensors``, or ``model-0000k-of-0000N.safetensors``
shards with ``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .errors import SpinQuantError
from .io import usual_mode

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_map(directory: Path, fix: str) -> dict[str, str]:
    """``{tensor name: shard file name}`` of a safetensors directory (sharded or single file)."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        from .io import read_json

        data = read_json(index, fix)
        if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
            raise SpinQuantError(f"{index} has no weight_map; {fix}")
        return data["weight_map"]
    single = directory / SINGLE
    if not single.is_file():
        raise SpinQuantError(f"{directory} has neither {SINGLE} nor {INDEX}; {fix}")
    with _open(single, fix) as f:
        return {name: SINGLE for name in f.keys()}


def _open(path: Path, fix: str):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise SpinQuantError(f"cannot read {path} ({e}); {fix}") from None


class ShardReader:
    """Reads single tensors (or row ranges) of a safetensors directory without loading the rest."""

    def __init__(self, directory: str | os.PathLike, fix: str = "re-download the model"):
        self.directory, self.fix = Path(directory), fix
        self.map = weight_map(self.directory, fix)
        self._files: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.map

    def names(self) -> list[str]:
        return list(self.map)

    def _file(self, name: str):
        if name not in self.map:
            raise SpinQuantError(f"{self.directory} has no tensor {name}; {self.fix}")
        shard = self.map[name]
        if shard not in self._files:
            self._files[shard] = _open(self.directory / shard, self.fix)
        return self._files[shard]

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        try:
            t = self._file(name).get_tensor(name)
        except SafetensorError as e:
            raise SpinQuantError(f"cannot read {name} from {self.directory} ({e}); {self.fix}") from None
        return t if dtype is None else t.to(dtype)

    def shape(self, name: str) -> list[int]:
        return list(self._file(name).get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of a 2-D tensor, read alone (an embedding table need not fit twice)."""
        t = self._file(name).get_slice(name)[start:stop]
        return t if dtype is None else t.to(dtype)


class ShardWriter:
    """Collects tensors into shards of about ``shard_bytes`` and writes each when full.

    Shards go to temporary names; ``close()`` renames them and writes the index last (a single shard
    becomes ``model.safetensors`` with no index, as transformers does), so an interrupted write never
    leaves a directory that loads. Use it as a context manager inside an atomic output directory."""

    def __init__(self, directory: str | os.PathLike, shard_bytes: int = 2 << 30, metadata: dict | None = None):
        self.directory, self.shard_bytes = Path(directory), shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._shard: dict[str, torch.Tensor] = {}
        self._size = 0
        self._written: list[tuple[Path, list[str]]] = []  # (temporary file, tensor names) per shard

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._shard[name] = tensor.detach().contiguous()
        self._size += tensor.numel() * tensor.element_size()
        if self._size >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if self._shard:
            tmp = self.directory / f".model-{len(self._written) + 1:05d}.safetensors.tmp"
            save_file(self._shard, str(tmp), metadata=self.metadata)
            self._written.append((tmp, list(self._shard)))
            self._shard, self._size = {}, 0

    def close(self) -> Path:
        """Write what is left, name the shards and write the index; returns the weights' entry file."""
        self.flush()
        if len(self._written) == 1:
            final = self.directory / SINGLE
            os.replace(self._written[0][0], final)
            usual_mode(final)
            return final
        mapping, total = {}, 0
        for k, (tmp, keys) in enumerate(self._written, 1):
            final = self.directory / f"model-{k:05d}-of-{len(self._written):05d}.safetensors"
            os.replace(tmp, final)
            usual_mode(final)
            total += final.stat().st_size
            mapping.update({key: final.name for key in keys})
        index = self.directory / INDEX
        tmp = index.with_suffix(".tmp")
        tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": mapping}, indent=2))
        os.replace(tmp, index)
        usual_mode(index)
        return index

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            for tmp, _ in self._written:
                tmp.unlink(missing_ok=True)
