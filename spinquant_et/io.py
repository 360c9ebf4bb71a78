"""Write outputs atomically: a temporary sibling that is renamed into place only when complete."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import SpinQuantError


def read_json(path: Path, fix: str):
    """The JSON in ``path``, or a one-line error naming the file, what is wrong and ``fix``."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpinQuantError(f"{path} not found; {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise SpinQuantError(f"{path} is not valid JSON ({type(e).__name__}{where}); {fix}") from None


def refuse_existing(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise SpinQuantError(f"{out} already exists; pass --force to overwrite it")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def usual_mode(path: Path) -> None:
    """Give a finished file the mode a plain ``open()`` would (0644 under the usual umask): temp files
    and safetensors' writer make them 0600."""
    path.chmod(0o666 & ~_umask())


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, force: bool = False):
    """Yield a temp directory next to ``out``; on success replace ``out`` with it, on error delete it."""
    out = Path(out)
    refuse_existing(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; a finished output gets the usual mode
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                usual_mode(f)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_file(out: str | os.PathLike, force: bool = False):
    """Yield a temp file path next to ``out``; on success rename it to ``out``, on error delete it."""
    out = Path(out)
    refuse_existing(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        usual_mode(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
