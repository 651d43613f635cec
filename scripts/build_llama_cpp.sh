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
cmake -S src -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
  > build.log 2>&1 || { tail -20 build.log >&2; exit 1; }
echo "build_llama_cpp: compiling (progress in $DEST/build.log)" >&2
cmake --build build -j "$(nproc)" --target llama-bench llama-batched-bench llama-quantize \
  llama-server >> build.log 2>&1 || { tail -30 build.log >&2; exit 1; }
echo "$DEST/build/bin"
