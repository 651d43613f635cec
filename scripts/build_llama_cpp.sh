#!/usr/bin/env bash
# Build llama.cpp's benchmark and conversion tools, the peer Strata is measured against, from
# the llama-cpp-python sdist (it vendors llama.cpp; only the package registry is needed).
#
#   scripts/build_llama_cpp.sh [DIR]     # default: $STRATA_HOME/llama.cpp (~/.cache/strata)
#
# Leaves DIR/build/bin/{llama-bench,llama-batched-bench,llama-quantize,llama-server} and the
# converter DIR/src/convert_hf_to_gguf.py (run it with the gguf package Strata already has).
# About 10 minutes on 2 cores. LLAMA_CPP_PYTHON_VERSION picks the release (default below).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DEST="${1:-${STRATA_HOME:-$HOME/.cache/strata}/llama.cpp}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$DEST"
cd "$DEST"

if [ ! -d "src" ]; then
  echo "build_llama_cpp: downloading the llama-cpp-python $VERSION sdist" >&2
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d sdist
  tar xzf "sdist/llama_cpp_python-$VERSION.tar.gz"
  mv "llama_cpp_python-$VERSION/vendor/llama.cpp" src
  rm -rf "llama_cpp_python-$VERSION"
fi

generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
# ggml's AMX kernels fill a tile configuration and load it with _tile_loadconfig; GCC 12.2
# drops those stores (it does not see the load read them), so every tile is left unconfigured
# and the first tile instruction traps (llama-bench died with SIGILL in the AMX Q8_0 kernel on a
# Xeon). -march=native compiles those kernels in on an AMX CPU: compile ggml's pattern with this
# compiler and run it first, and build without AMX if it traps.
native_flags=()
if grep -qw amx_tile /proc/cpuinfo; then
  cat > amx_probe.c << 'PROBE'
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
int main(void)
{
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */))
        return 1;
    struct tile_config tc __attribute__((aligned(64))) = {0};
    tc.palette_id = 1;
    tc.rows[0] = 16;
    tc.colsb[0] = 64;
    _tile_loadconfig(&tc);
    _tile_zero(0);
    _tile_release();
    return 0;
}
PROBE
  if ! { cc -O2 -mamx-tile amx_probe.c -o amx_probe && ./amx_probe; } 2> /dev/null; then
    echo "build_llama_cpp: AMX code from this compiler traps here; building without AMX" >&2
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    native_flags=("-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx")
  fi
  rm -f amx_probe amx_probe.c
fi
cmake -S src -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  "${native_flags[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
  > build.log 2>&1 || { tail -20 build.log >&2; exit 1; }
echo "build_llama_cpp: compiling (progress in $DEST/build.log)" >&2
cmake --build build -j "$(nproc)" --target llama-bench llama-batched-bench llama-quantize \
  llama-server >> build.log 2>&1 || { tail -30 build.log >&2; exit 1; }
echo "$DEST/build/bin"
