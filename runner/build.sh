#!/usr/bin/env bash
# Build spinquant-run.
#   bash runner/build.sh                    runner/build/spinquant-run for this machine, against the installed
#                                           executorch wheel (its shared libraries stay where pip put them)
#   bash runner/build.sh --target aarch64   runner/build-aarch64/: spinquant-run for 64-bit ARM Linux and lib/
#                                           with the shared libraries it needs; copy the folder to a board
# The executorch wheel is the one of $PYTHON if set, else of the repository's .venv if there is one, else of
# the python on PATH (an activated venv). --target aarch64 cross-compiles against the aarch64 wheel of that
# same executorch version (pip download, cached in runner/.cache/).
# Needs cmake, g++, pkg-config, libpcre2-dev, nlohmann-json3-dev; --target aarch64 also g++-aarch64-linux-gnu
# and libpcre2-dev:arm64 (Debian multiarch). Installed with apt-get when missing and run as root.
set -euo pipefail
cd "$(dirname "$0")"
TARGET=host
while [ $# -gt 0 ]; do
  case "$1" in
    --target) TARGET=${2:-}; shift 2 || { echo "error: --target needs a value (host or aarch64)" >&2; exit 2; } ;;
    --target=*) TARGET=${1#--target=}; shift ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$TARGET" in
  host|native) TARGET=host ;;
  aarch64|arm64) TARGET=aarch64 ;;
  *) echo "error: unknown --target $TARGET; use host or aarch64" >&2; exit 2 ;;
esac

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x ../.venv/bin/python ]; then PY=../.venv/bin/python
else PY=$(command -v python3 || command -v python || true)
fi
if [ -z "$PY" ] || ! "$PY" -c 'import executorch' 2>/dev/null; then
  echo "error: no Python with executorch found (tried \$PYTHON, ../.venv/bin/python, python3 on PATH); run scripts/setup.sh or set PYTHON" >&2
  exit 2
fi

# cmake --build with its progress lines dropped; a failed compile fails the script (an older binary left in
# the folder must not pass for a new one)
compile() {
  local rc=0
  cmake --build "$1" -j "$(nproc)" > "$1/build.log" 2>&1 || rc=$?
  grep -v -E "^\[ *[0-9]+%\]" "$1/build.log" || true
  if [ $rc -ne 0 ]; then echo "error: the build failed (log: $(pwd)/$1/build.log)" >&2; exit 1; fi
}

# Debian packages: installed when missing and root, else one line naming them.
need_packages() {
  local missing=() pkg
  for pkg in "$@"; do dpkg -s "$pkg" > /dev/null 2>&1 || missing+=("$pkg"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    if printf '%s\n' "${missing[@]}" | grep -q ':arm64$' && ! dpkg --print-foreign-architectures | grep -qx arm64; then
      dpkg --add-architecture arm64
    fi
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" > /dev/null
  else
    echo "error: the $TARGET build needs: sudo dpkg --add-architecture arm64 && sudo apt-get update && sudo apt-get install ${missing[*]}" >&2
    exit 2
  fi
}

if [ "$TARGET" = host ]; then
  ET_CMAKE=$("$PY" -c 'import executorch, os; print(os.path.join(list(executorch.__path__)[0], "share", "cmake"))')
  mkdir -p build
  if ! cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -Dexecutorch_DIR="$ET_CMAKE" > build/cmake.log 2>&1; then
    cat build/cmake.log >&2
    exit 1
  fi
  compile build
  test -x build/spinquant-run
  echo "built $(pwd)/build/spinquant-run"
  exit 0
fi

# --target aarch64
if dpkg --print-architecture 2>/dev/null | grep -qx arm64; then
  echo "error: this machine is arm64 already: run bash runner/build.sh without --target" >&2
  exit 2
fi
need_packages cmake pkg-config nlohmann-json3-dev g++-aarch64-linux-gnu libpcre2-dev:arm64
VERSION=$("$PY" -c 'from importlib.metadata import version; print(version("executorch"))')
PYTAG=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
CACHE=.cache/executorch-$VERSION-aarch64
if [ ! -f "$CACHE/executorch/share/cmake/executorch-config.cmake" ]; then
  mkdir -p .cache/wheels
  echo "fetching the aarch64 wheel of executorch $VERSION (pip download)"
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
       --python-version "$PYTAG" "executorch==$VERSION" -d .cache/wheels > .cache/pip.log 2>&1; then
    echo "error: pip download of executorch==$VERSION for manylinux_2_28_aarch64 failed (see runner/.cache/pip.log)" >&2
    exit 1
  fi
  WHEEL=$(ls .cache/wheels/executorch-"$VERSION"-*aarch64*.whl | head -n 1)
  rm -rf "$CACHE.tmp" && mkdir -p "$CACHE.tmp"
  "$PY" - "$WHEEL" "$CACHE.tmp" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:  # the runtime's part: headers, libraries, CMake package
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith(("executorch/include/", "executorch/lib/",
                                                                          "executorch/share/"))])
EOF
  rm -rf "$CACHE" && mv "$CACHE.tmp" "$CACHE"
fi
OUT=build-aarch64
mkdir -p "$OUT/cmake"
if ! cmake -S . -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release -DCMAKE_TOOLCHAIN_FILE="$(pwd)/cmake/aarch64-linux-gnu.cmake" \
     -DSPINQUANT_PORTABLE=ON -Dexecutorch_DIR="$(pwd)/$CACHE/executorch/share/cmake" > "$OUT/cmake.log" 2>&1; then
  cat "$OUT/cmake.log" >&2
  exit 1
fi
compile "$OUT/cmake"
test -x "$OUT/cmake/spinquant-run"
# The folder to copy (CMakeLists.txt's install rules). glibc and libstdc++ are the board's own: the
# toolchain's libstdc++ would need glibc 2.36, where the binary needs 2.34 and the wheel's libraries 2.27
# (tests/test_runner_aarch64.py).
rm -rf "$OUT/lib"
cmake --install "$OUT/cmake" --prefix "$(pwd)/$OUT" > "$OUT/install.log" 2>&1 || {
  cat "$OUT/install.log" >&2
  exit 1
}
echo "built $(pwd)/$OUT/spinquant-run (aarch64; copy $(pwd)/$OUT to the board and run ./spinquant-run there)"
