"""Safetensors weights one tensor at a time: read from a model's shards, write into new shards.

What lets ``quantize`` and ``make_model`` handle models larger than memory: a reader that loads
only the tensor (or the rows of it) asked for, and a writer that holds one shard at a time.

Layout, as transformers writes it: one ``model.safetensors``, or ``model-0000k-of-0000N.safetensors``
shards with ``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import contextmanager
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
    """Reads single tensors (or row ranges) of a safetensors directory without loading the rest.

    Each read opens its shard and lets it go, and returns a tensor of its own: safetensors maps the file
    and its tensors are views of the mapping, so a handle or view kept alive keeps every page read through
    it resident (streaming the Llama-3.1-8B shape would hold its 16 GB of shards in RSS)."""

    def __init__(self, directory: str | os.PathLike, fix: str = "re-download the model"):
        self.directory, self.fix = Path(directory), fix
        self.map = weight_map(self.directory, fix)

    def __contains__(self, name: str) -> bool:
        return name in self.map

    def names(self) -> list[str]:
        return list(self.map)

    @contextmanager
    def _file(self, name: str):
        if name not in self.map:
            raise SpinQuantError(f"{self.directory} has no tensor {name}; {self.fix}")
        try:
            with _open(self.directory / self.map[name], self.fix) as f:
                yield f
        except SafetensorError as e:
            raise SpinQuantError(f"cannot read {name} from {self.directory} ({e}); {self.fix}") from None

    def check(self) -> None:
        """A one-line error now, not minutes later, if a shard is unreadable or lacks a tensor it should hold."""
        for shard in sorted(set(self.map.values())):
            with _open(self.directory / shard, self.fix) as f:
                missing = {n for n, s in self.map.items() if s == shard} - set(f.keys())
            if missing:
                raise SpinQuantError(f"{self.directory / shard} lacks {sorted(missing)[0]}; {self.fix}")

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        with self._file(name) as f:
            t = f.get_tensor(name)
            return t.clone() if dtype in (None, t.dtype) else t.to(dtype)

    def shape(self, name: str) -> list[int]:
        with self._file(name) as f:
            return list(f.get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of a 2-D tensor, read alone (an embedding table need not fit twice)."""
        with self._file(name) as f:
            t = f.get_slice(name)[start:stop]
            return t.clone() if dtype in (None, t.dtype) else t.to(dtype)


class ShardTensors(Mapping):
    """A safetensors directory as a read-only ``{name: tensor}`` mapping whose tensors are read when asked
    for and not kept: a consumer that lets each one go holds one at a time, not the checkpoint."""

    def __init__(self, reader: ShardReader):
        self.reader = reader

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.reader:
            raise KeyError(name)
        return self.reader.get(name)

    def __iter__(self):
        return iter(self.reader.map)

    def __len__(self) -> int:
        return len(self.reader.map)


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
