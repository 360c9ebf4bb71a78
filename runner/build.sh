#!/usr/bin/env bash
# Build runner/build/spinquant-run against the executorch wheel installed in .venv (or $PYTHON).
# Needs: cmake, g++, pkg-config, libpcre2-dev, nlohmann-json3-dev (apt-get install them; .ci/run does).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-../.venv/bin/python}
ET_CMAKE=$("$PY" -c 'import executorch, os; print(os.path.join(list(executorch.__path__)[0], "share", "cmake"))')
mkdir -p build
if ! cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -Dexecutorch_DIR="$ET_CMAKE" > build/cmake.log 2>&1; then
  cat build/cmake.log >&2
  exit 1
fi
cmake --build build -j "$(nproc)" 2>&1 | grep -v -E "^\[ *[0-9]+%\]" || true
test -x build/spinquant-run
echo "built $(pwd)/build/spinquant-run"
