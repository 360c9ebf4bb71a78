"""Library noise off at the default verbosity, on with ``-v``.

torch, torchao, transformers and ExecuTorch print pages of FutureWarning/UserWarning lines, INFO
logs and, from ExecuTorch's C++ runtime, cpuinfo probes that a user cannot act on. Python warnings
and loggers are silenced by level; the C++ lines go straight to file descriptor 2, so the one place
that triggers them (loading a program) runs with fd 2 captured, and what was captured is handed to
the caller (a load that fails names the missing operator from it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings

OWN_LOGGER = "spinquant_et"
_LIBRARY_LOGGERS = ("torch", "torchao", "transformers", "executorch", "huggingface_hub")
_verbose = False


def configure(verbose: bool) -> None:
    """Logging for a CLI run: our INFO lines always, library warnings and logs only when ``verbose``."""
    global _verbose
    _verbose = verbose
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger().setLevel(logging.DEBUG if verbose else logging.WARNING)  # e.g. ExecuTorch's INFO root lines
    logging.getLogger(OWN_LOGGER).setLevel(logging.DEBUG if verbose else logging.INFO)
    if verbose:
        return
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch  # noqa: F401  (its import resets the torch loggers' levels: silence them after it)

    silence_library_loggers()


def silence_library_loggers() -> None:
    """Library loggers to ERROR. Call again after a library import: ``import torch`` resets the level
    of the ``torch`` loggers it configures, and torchao logs (at import) through them."""
    if _verbose:
        return
    for name in _LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name in list(logging.root.manager.loggerDict):
        if name.split(".")[0] in _LIBRARY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


class Captured:
    text: str = ""


@contextlib.contextmanager
def native_stderr():
    """Capture what C/C++ code writes to fd 2 inside the block (unless ``-v``); yields a ``Captured``
    whose ``text`` holds it afterwards. Python's own ``sys.stderr`` writes are captured too, so keep
    the block to the native call."""
    captured = Captured()
    if _verbose:
        yield captured
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.text = sink.read().decode(errors="replace")
