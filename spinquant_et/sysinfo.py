"""Process facts the benchmarks report."""

from __future__ import annotations

import resource


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB.

    ``VmHWM`` first: ``ru_maxrss`` survives ``exec``, so a child started from a large parent (a
    benchmark driver) would report the parent's peak instead of its own.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:  # not Linux
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux KiB; macOS reports bytes, but has no /proc
