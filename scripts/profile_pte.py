"""Where a ``.pte``'s decode time goes: milliseconds per token by operator, from ExecuTorch's ETDump.

    python scripts/profile_pte.py bench_out/8da4w_R1_R4-512.pte [--prompt-tokens 128 --steps 64]

Runs one prompt, then ``--steps`` single-token decode calls through the KV cache (2 XNNPACK threads,
as the runners use; through the methods our runners choose (``forward_near``, ``forward_ctx``), through
``forward`` with ``--forward-only``, or as the runners would choose among ``--methods`` only: e.g.
``--methods forward,forward_ctx`` profiles a file as a program without ``forward_near``), and prints
one markdown table: each kind of operator (XNNPACK's own operator names inside delegate calls;
``native_call_*`` and custom ops outside them), its calls per token,
its milliseconds per token and its share of ``Method::execute``. "delegate call overhead" is the
delegate calls' time not spent in any XNNPACK operator: ExecuTorch's XNNPACK executor reshapes the
whole XNNPACK runtime (every operator, then its memory plan) and sets it up again before every call,
whether shapes changed or not, so it grows with the operators in a partition (about 1 us each).
The first heavy operator after a stretch outside XNNPACK also runs 20-40 us slower than the same
operator elsewhere (its threads wake up). Profiling itself adds a little time; compare shares
between files rather than absolute figures with ``bench``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: see spinquant_et.runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def profile(pte: Path, prompt_tokens: int, steps: int, methods: set[str] | None = None) -> tuple[dict[str, list[float]], float]:
    """``{operator kind: [calls per token, ms per token]}`` over the decode steps, and ms per token; the
    runtime chooses among ``methods`` (default: all the program has)."""
    import torch
    from executorch.devtools import Inspector

    from spinquant_et.errors import SpinQuantError
    from spinquant_et.runtime import PteModel

    model = PteModel(pte, etdump=True)
    if methods is not None:
        if "forward" not in methods or not methods <= model.methods:
            raise SpinQuantError(f"--methods must include forward and only name methods of {pte}: "
                                 f"{', '.join(sorted(model.methods))}")
        model.methods = set(methods)
    if prompt_tokens + steps >= model.max_seq_len:
        raise SpinQuantError(f"--prompt-tokens + --steps must stay below the program's max_seq_len {model.max_seq_len}")
    generator = torch.Generator().manual_seed(0)
    model.forward(torch.randint(0, 100, (prompt_tokens,), generator=generator).tolist(), 0)
    for i in range(steps):
        model.forward([7], prompt_tokens + i)
    with tempfile.TemporaryDirectory() as tmp:
        etdump = os.path.join(tmp, "run.etdp")
        # the API takes a debug-buffer path too; nothing is recorded there
        model.program.write_etdump_result_to_file(etdump, os.path.join(tmp, "debug.bin"))
        inspector = Inspector(etdump_path=etdump)
    ms, calls, inside = collections.Counter(), collections.Counter(), 0.0
    prompt_seen = False
    for block in inspector.event_blocks:  # one per method, in the order of their first calls
        if not any(event.name == "DELEGATE_CALL" for event in block.events):
            continue  # a metadata method (get_max_seq_len, ...)
        # The first model method to run (the one runtime.choose_method picks for the prompt) takes the
        # prompt in its first call; every other call is a decode step.
        skip = 0 if prompt_seen else 1
        prompt_seen = True
        for event in block.events:
            if event.perf_data is None:
                continue
            decode = event.perf_data.raw[skip:]
            kind = re.sub(r" #\d+$", "", event.name)  # XNNPACK numbers operators of one kind per partition
            ms[kind] += sum(decode) / steps
            calls[kind] += len(decode) / steps
            if event.is_delegated_op:
                inside += sum(decode) / steps
    total = ms.pop("Method::execute", 0.0)
    for name in ("Method::init", "Program::load_method", "OPERATOR_CALL"):
        ms.pop(name, None)
    if "DELEGATE_CALL" in ms:
        ms["delegate call overhead"] = ms.pop("DELEGATE_CALL") - inside
        calls["delegate call overhead"] = calls["DELEGATE_CALL"]
    return {k: [calls[k], v] for k, v in ms.items()}, total


def table(rows: dict[str, list[float]], total: float) -> str:
    lines = ["| operator | calls per token | ms per token | share |", "|---|---|---|---|"]
    for name, (n, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {n:.0f} | {ms:.3f} | {ms / total:.1%} |")
    lines.append(f"| **Method::execute** | 1 | {total:.3f} | 100% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from spinquant_et.errors import SpinQuantError

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pte", type=Path)
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length before the decode steps (default 128)")
    p.add_argument("--steps", type=int, default=64, help="profiled decode steps (default 64)")
    p.add_argument("--forward-only", action="store_true", help="decode through forward, not forward_near/forward_ctx")
    p.add_argument("--methods", help="comma-separated methods the runtime may choose from (forward among them; "
                   "default: all the program has)")
    args = p.parse_args(argv)
    methods = {"forward"} if args.forward_only else set(args.methods.split(",")) if args.methods else None
    try:
        rows, total = profile(args.pte, args.prompt_tokens, args.steps, methods)
    except SpinQuantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.pte}: decode after a {args.prompt_tokens}-token prompt, mean of {args.steps} steps"
          + (f" (methods: {', '.join(sorted(methods))})" if methods else ""))
    print(table(rows, total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
