"""Transparent huge pages for the runtime's heap: decode reads every packed weight once per token, and
with 4 KiB pages that stream walks the page tables (SmolLM2's ~100 MB of XNNPACK-packed weights are
25,000 pages; a core's TLB holds about 2,000). Where THP is ``madvise`` (Debian's and Ubuntu's default),
glibc backs ``malloc`` with huge pages only when its ``glibc.malloc.hugetlb=1`` tunable is set, and
tunables are read once, when a process starts. So the runners (``spinquant-et generate/bench/eval X.pte``
and ``runner/src/main.cpp``) start themselves again with it set. SmolLM2 W4A8 on this 2-core VM,
alternating runs: the C++ runner decoded 152-166 against 135-141 tok/s, our Python runtime 6.8-7.0
against 7.1-7.6 ms a step; llama.cpp, which maps its GGUF file (file pages get no THP), decoded the same
either way. A ``glibc.malloc.hugetlb`` already in ``GLIBC_TUNABLES`` (``=0`` turns it off) is left alone.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``: the bracketed word), None if unknown."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def tunables_with_huge_pages(tunables: str | None, mode: str | None, libc: str) -> str | None:
    """``GLIBC_TUNABLES`` with huge pages for malloc, or None where that changes nothing: not glibc, THP
    not ``madvise`` (``always`` already gives them, ``never`` refuses), or the user set the tunable."""
    if libc != "glibc" or mode != "madvise" or (tunables and TUNABLE in tunables):
        return None
    return f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"


def huge_page_tunables(environ=os.environ) -> str | None:
    """What ``GLIBC_TUNABLES`` should be in ``environ`` for malloc on huge pages on this machine, or None
    where it is right as it is (``tunables_with_huge_pages``)."""
    return tunables_with_huge_pages(environ.get("GLIBC_TUNABLES"), thp_mode(), platform.libc_ver()[0])


def restart_with_huge_pages() -> None:
    """Start this Python command again (same arguments) with malloc on huge pages, if that helps here.
    Call it first thing: the new process redoes all the work done before. Returns only where nothing
    changes (or the restart failed)."""
    value = huge_page_tunables()
    if value is None:
        return
    os.environ["GLIBC_TUNABLES"] = value
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, sys.orig_argv)
    except OSError:  # keep running as we are
        pass


def describe() -> str:
    """One line for ``-v``: whether this process's malloc asked for huge pages."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return f"THP mode {thp_mode()}; GLIBC_TUNABLES={tunables!r}"
