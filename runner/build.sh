#!/usr/bin/env bash
# Build runner/build/spinquant-run against the installed executorch wheel: the one of $PYTHON if set,
# else of the repository's .venv if there is one, else of the python on PATH (an activated venv).
# Needs: cmake, g++, pkg-config, libpcre2-dev, nlohmann-json3-dev (apt-get install them; .ci/run does).
set -euo pipefail
cd "$(dirname "$0")"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x ../.venv/bin/python ]; then PY=../.venv/bin/python
else PY=$(command -v python3 || command -v python || true)
fi
if [ -z "$PY" ] || ! "$PY" -c 'import executorch' 2>/dev/null; then
  echo "error: no Python with executorch found (tried \$PYTHON, ../.venv/bin/python, python3 on PATH); run scripts/setup.sh or set PYTHON" >&2
  exit 2
fi
ET_CMAKE=$("$PY" -c 'import executorch, os; print(os.path.join(list(executorch.__path__)[0], "share", "cmake"))')
mkdir -p build
if ! cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -Dexecutorch_DIR="$ET_CMAKE" > build/cmake.log 2>&1; then
  cat build/cmake.log >&2
  exit 1
fi
cmake --build build -j "$(nproc)" 2>&1 | grep -v -E "^\[ *[0-9]+%\]" || true
test -x build/spinquant-run
echo "built $(pwd)/build/spinquant-run"
