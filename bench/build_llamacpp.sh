#!/usr/bin/env bash
# Builds llama-cpp-python 0.3.36 from its sdist with our fix for llama.cpp's AMX matmul
# (bench/llamacpp-amx-gcc12.patch) and installs it into a venv, for the llama.cpp peer of
# the benchmarks (bench/llamacpp_peer.py; `make bench-llamacpp`).
#
# Why patched: ggml's AMX matmul builds its tile configuration on the stack, and GCC 12's
# _tile_loadconfig tells the compiler it reads only 8 bytes of it, so the stores that set
# the tiles' rows and widths are dropped as dead and ldtilecfg faults (SIGSEGV) on the
# first prompt on an AMX CPU (upstream llama.cpp issue 20824, PR 26954). The patch builds
# the configuration at compile time in static storage, and loads it on every matmul call
# rather than once per thread: torch's oneDNN, in the same process in the benchmarks,
# releases the tiles on the same OpenMP threads, and llama.cpp's next tile instruction
# was then an invalid opcode (SIGILL). It only touches code compiled for AMX CPUs, so
# elsewhere it changes nothing.
#
#   bench/build_llamacpp.sh [VENV]   VENV defaults to .venv (relative to the repository root)
#
# -DGGML_NATIVE=ON compiles for this CPU (AMX where it has it), so the wheel runs only on
# CPUs with the same instruction sets. Multimodal support (mtmd) is not built: the bench
# does not use it and it adds minutes. --no-deps everywhere, so nothing can pull torch or
# CUDA packages; the Makefile installs the four small runtime dependencies by name.
# The wheel is also kept in build/llamacpp/ for installing elsewhere on the same CPU kind.
set -euo pipefail

VERSION=0.3.36
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PYTHON="$VENV/bin/python"
PATCH="$PWD/bench/llamacpp-amx-gcc12.patch"
WHEELS="$PWD/build/llamacpp"

if [[ ! -x "$PYTHON" ]]; then
    echo "build_llamacpp: no interpreter at $PYTHON (make .venv/.installed first)" >&2
    exit 2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m pip download -q --no-binary :all: --no-deps -d "$work" \
    "llama-cpp-python==$VERSION"
tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
src="$work/llama_cpp_python-$VERSION"

# Dry run first, so a patch that no longer applies stops the build before anything
# is half-applied.
if ! patch -d "$src" -p1 --batch --forward --dry-run <"$PATCH" >/dev/null; then
    echo "build_llamacpp: $PATCH no longer applies to llama-cpp-python $VERSION" >&2
    exit 1
fi
patch -d "$src" -p1 --batch --forward <"$PATCH"

export CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
nice -n 10 "$PYTHON" -m pip wheel --no-deps -w "$work/wheel" "$src"

mkdir -p "$WHEELS"
wheel=$(find "$work/wheel" -name "llama_cpp_python-$VERSION-*.whl")
cp "$wheel" "$WHEELS/"
"$PYTHON" -m pip install --no-deps --force-reinstall "$WHEELS/$(basename "$wheel")"
echo "build_llamacpp: installed $(basename "$wheel") into $VENV (kept in $WHEELS)"
