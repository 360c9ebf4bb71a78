"""Huge pages for the runners' malloc: when the restart with glibc's tunable happens, and that both runners
(a real command line: the CLI, the C++ binary) come back with it set exactly where it helps."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from spinquant_et.hugepages import thp_mode, tunables_with_huge_pages


def test_tunable_added_only_where_it_changes_something():
    assert tunables_with_huge_pages(None, "madvise", "glibc") == "glibc.malloc.hugetlb=1"
    assert tunables_with_huge_pages("", "madvise", "glibc") == "glibc.malloc.hugetlb=1"
    # the user's other tunables kept
    assert (tunables_with_huge_pages("glibc.malloc.arena_max=2", "madvise", "glibc")
            == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")
    # the user's own choice (=0: off), THP already always on or refused, another libc: nothing to do
    assert tunables_with_huge_pages("glibc.malloc.hugetlb=0", "madvise", "glibc") is None
    for mode in ("always", "never", None):
        assert tunables_with_huge_pages(None, mode, "glibc") is None
    assert tunables_with_huge_pages(None, "madvise", "") is None


def test_thp_mode_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(str(f)) == "always"
    assert thp_mode(str(tmp_path / "missing")) is None


def _expected_tunables() -> str:
    helps = thp_mode() == "madvise" and platform.libc_ver()[0] == "glibc"
    return "glibc.malloc.hugetlb=1" if helps else ""


def test_cli_restarts_with_huge_pages_unless_told_not_to(tiny_pte):
    """`spinquant-et generate` from a command line: -v names the tunables the running process has."""
    def tunables_seen(env_value: str) -> str:
        env = {**os.environ, "GLIBC_TUNABLES": env_value}
        r = subprocess.run([sys.executable, "-m", "spinquant_et.cli", "generate", str(tiny_pte), "--prompt", "hi",
                            "--max-new-tokens", "2", "-v"], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        line = next(line for line in r.stderr.splitlines() if "GLIBC_TUNABLES=" in line)
        return line.split("GLIBC_TUNABLES=")[1].strip("'")

    assert tunables_seen("") == _expected_tunables()
    assert tunables_seen("glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0"


def test_cpp_runner_restarts_with_huge_pages(runner_binary, tiny_pte):
    env = {**os.environ, "GLIBC_TUNABLES": ""}
    r = subprocess.run([str(runner_binary), "--model", str(tiny_pte), "--prompt", "hi", "--max-new-tokens", "2",
                        "--verbose"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"spinquant-run: GLIBC_TUNABLES={_expected_tunables()}\n" in r.stderr


@pytest.mark.skipif(thp_mode() != "madvise", reason="the restart only happens where THP is madvise")
def test_restart_keeps_the_command_and_its_result(tiny_pte):
    """The restarted CLI runs the same command: the same greedy tokens as with 4 KiB pages."""
    outs = []
    for value in ("", "glibc.malloc.hugetlb=0"):
        env = {**os.environ, "GLIBC_TUNABLES": value}
        r = subprocess.run([sys.executable, "-m", "spinquant_et.cli", "generate", str(tiny_pte), "--prompt",
                            "The data model", "--max-new-tokens", "8"], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout)
    assert outs[0] == outs[1] and outs[0].strip()
