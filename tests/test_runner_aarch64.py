"""The ARM64 runner (`runner/build.sh --target aarch64`): a folder with an aarch64 binary and the libraries it
needs beside it, whose greedy tokens under qemu-user equal the x86-64 runner's. The demo model's are checked in
test_e2e_export_smollm2.py."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

from conftest import QEMU_AARCH64

EM_AARCH64 = 183
# what the board provides: glibc and the GCC runtime
SYSTEM = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "ld-linux-aarch64.so.1", "librt.so.1",
          "libstdc++.so.6", "libgcc_s.so.1"}


def elf_machine(path: Path) -> int:
    head = path.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and head[4] == 2 and head[5] == 1  # 64-bit little-endian
    return struct.unpack_from("<H", head, 18)[0]


def dynamic(path: Path) -> tuple[list[str], list[str]]:
    """NEEDED and RUNPATH entries, read with the cross binutils' readelf."""
    out = subprocess.run(["aarch64-linux-gnu-readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    runpath = [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(RUNPATH)" in line]
    return needed, runpath


def under_qemu(binary: Path, *args, stdin: str | None = None):
    return subprocess.run([*QEMU_AARCH64, str(binary), *map(str, args)], input=stdin, capture_output=True, text=True,
                          timeout=600)


def test_the_build_is_an_arm64_folder_to_copy(aarch64_runner):
    assert elf_machine(aarch64_runner) == EM_AARCH64
    if shutil.which("file"):
        assert "ARM aarch64" in subprocess.run(["file", str(aarch64_runner)], capture_output=True, text=True).stdout
    needed, runpath = dynamic(aarch64_runner)
    assert runpath == ["$ORIGIN/lib"]
    lib = aarch64_runner.parent / "lib"
    bundled = {p.name for p in lib.iterdir()}
    assert not [n for n in needed if n not in SYSTEM and n not in bundled], (needed, bundled)
    assert "libexecutorch.so" in needed and not [n for n in needed if "pcre2" in n]  # PCRE2 is linked in
    for so in lib.iterdir():
        assert elf_machine(so) == EM_AARCH64, so
        assert not [n for n in dynamic(so)[0] if n not in SYSTEM and n not in bundled], so


# An argmax swap between two logits closer than this is rounding, not a wrong program: ARM's int8 kernels (KleidiAI
# inside XNNPACK) sum in another order than x86's. The tiny random model's logits spread about 0.24 (std); its
# two ARM-vs-x86 swaps seen were at gaps of 3.2e-3 and below.
NEAR_TIE = 0.02


def agreed_positions(pte: Path, prompt: str, reference: list[int], other: list[int]) -> int:
    """How many greedy tokens ``other`` shares with ``reference`` (the x86 runner's), asserting that they part only
    where the x86 program's top two logits lie within NEAR_TIE (after that the contexts differ)."""
    import torch
    from transformers import AutoTokenizer

    from spinquant_et.runtime import PteModel

    ids = AutoTokenizer.from_pretrained(pte.parent).encode(prompt, add_special_tokens=False)
    model = PteModel(pte)  # the x86 runner's own kernels: its tokens equal the Python runtime's (test_runner.py)
    logits = model.forward(ids, 0)
    for i, (ref, got) in enumerate(zip(reference, other, strict=True)):
        if ref != got:
            top2 = torch.topk(logits.float(), 2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE and float(logits[got]) >= float(top2[1]), (i, ref, got)
            return i
        logits = model.forward([ref], len(ids) + i)
    return len(reference)


def newest_version(path: Path, prefix: str) -> tuple[int, ...]:
    """The newest symbol version ``prefix`` (GLIBC_, GLIBCXX_) that ``path`` needs."""
    import re

    out = subprocess.run(["aarch64-linux-gnu-objdump", "-T", str(path)], capture_output=True, text=True, check=True).stdout
    versions = [tuple(map(int, v.split("."))) for v in re.findall(rf"\b{prefix}_([0-9.]+)\b", out)]
    return max(versions, default=())


def test_the_folder_runs_on_glibc_2_34_and_gcc_9_runtimes(aarch64_runner):
    """What README promises a board needs: glibc >= 2.34 (Debian 12, Ubuntu 22.04, Raspberry Pi OS 12) and
    libstdc++ >= GCC 9's (GLIBCXX_3.4.26)."""
    files = [aarch64_runner, *(aarch64_runner.parent / "lib").iterdir()]
    assert max(newest_version(f, "GLIBC") for f in files) <= (2, 34)
    assert max(newest_version(f, "GLIBCXX") for f in files) <= (3, 4, 26)


def test_greedy_tokens_under_qemu_equal_the_x86_runner(aarch64_runner, runner_binary, tiny_pte):
    prompt = "The data model of Python"
    args = ("--model", tiny_pte, "--prompt", prompt, "--max-new-tokens", 32, "--ids", "--ignore-eos")
    x86 = subprocess.run([str(runner_binary), *map(str, args)], capture_output=True, text=True, timeout=300)
    arm = under_qemu(aarch64_runner, *args)
    assert x86.returncode == 0 and arm.returncode == 0, arm.stderr
    ref, got = [int(t) for t in x86.stdout.split()], [int(t) for t in arm.stdout.split()]
    assert len(got) == 32 and agreed_positions(tiny_pte, prompt, ref, got) >= 8


def test_interactive_chat_runs_under_qemu(aarch64_runner, tiny_chat_pte):
    r = under_qemu(aarch64_runner, "--model", tiny_chat_pte, "--interactive", "--max-new-tokens", 8, "--ids",
                   stdin="hello\ntell me more\n")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2 and len([x for x in r.stderr.splitlines() if x.startswith("ttft ")]) == 2
