#!/usr/bin/env python
"""Peak RSS of each stage of one ``spinquant-et`` command, to find which stage sets a model's peak.

    python scripts/bench_stage_memory.py export --model out/ckpt/llama-3.1-8b --out out/l8b.pte --force

Runs the command in this process with a sampler thread reading ``VmRSS`` every 0.1 s, and marks stage
boundaries by wrapping the entry points the export path goes through (build the exportable model,
``torch.export`` of each method, decomposition and partitioning as the lowering's progress line reports
them, each XNNPACK preprocessing call, emission, writing). Prints each stage's peak in MiB and the
process's ``ru_maxrss``; ``--log FILE`` also writes the lines as they happen. ``/usr/bin/time -v``
gives the same overall peak; this says where it is.
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


class StageMemory:
    def __init__(self, log):
        self.stage, self.peaks, self.t0, self.log = "start", {}, time.time(), log
        threading.Thread(target=self._sample, daemon=True).start()

    def _record(self, stage: str) -> None:
        stage = stage.split(" #")[0]  # preprocessing calls are logged one by one, summed up as one
        self.peaks[stage] = max(self.peaks.get(stage, 0.0), rss_mib())

    def _sample(self) -> None:
        while True:
            self._record(self.stage)
            time.sleep(0.1)

    def mark(self, stage: str) -> None:
        self._record(self.stage)  # a stage shorter than the sampling period still gets its RSS at both ends
        self.stage = stage
        self._record(stage)
        if self.log:
            print(f"{time.time() - self.t0:8.1f} s {rss_mib():8.0f} MiB -> {stage}", file=self.log, flush=True)

    def wrap(self, owner, name: str, label, after: str | None = None, static: bool = False) -> None:
        """Mark ``label(*args)`` when ``owner.name`` is called (and ``after`` when it returns)."""
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            self.mark(label(*args, **kwargs))
            result = original(*args, **kwargs)
            if after:
                self.mark(after)
            return result

        setattr(owner, name, staticmethod(wrapped) if static else wrapped)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=argparse.FileType("w"), help="also write each stage as it starts")
    args, command = parser.parse_known_args()
    probe = StageMemory(args.log)

    import executorch.exir.program._program as program
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    import spinquant_et.export.lower as lower
    import spinquant_et.export.pipeline as pipeline

    count = iter(range(1, 1 << 30))
    probe.wrap(pipeline, "build_transformer", lambda *a, **k: "build", after="lower: export")
    probe.wrap(lower._Stages, "start", lambda self, label: f"lower: {label}")
    probe.wrap(XnnpackBackend, "preprocess", lambda *a: f"XNNPACK preprocess #{next(count)}", static=True)
    probe.wrap(program.EdgeProgramManager, "to_executorch", lambda *a, **k: "emit", after="emitted")
    probe.wrap(program.ExecutorchProgramManager, "write_to_file", lambda *a: "write", after="written")

    from spinquant_et.cli import main as cli

    sys.argv = ["spinquant-et", *command]
    try:
        return cli()
    finally:
        probe.mark("end")
        time.sleep(0.2)
        print("peak RSS by stage (MiB):")
        for stage, peak in probe.peaks.items():
            print(f"  {peak:8.0f}  {stage}")
        print(f"ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    sys.exit(main())
