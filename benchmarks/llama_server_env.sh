#!/usr/bin/env bash
# llama.cpp's llama-server and llama-quantize, for benchmarks/serve.py only (never a dependency of
# hloserve): built from the llama.cpp tree vendored in llama-cpp-python's source distribution
# (llama.cpp itself is not on PyPI as a binary), natively for this CPU.
#
#     bash benchmarks/llama_server_env.sh [DIR]   # default: ~/.cache/hloserve/bench/llama.cpp
#
# Leaves DIR/bin/llama-server and DIR/bin/llama-quantize; about 10 minutes on 2 cores, once.
# Idempotent: an existing build is kept (delete DIR to rebuild, e.g. on another CPU).
set -euo pipefail

DIR=${1:-${LLAMA_CPP_DIR:-$HOME/.cache/hloserve/bench/llama.cpp}}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
JOBS=${JOBS:-2}

if [ -x "$DIR/bin/llama-server" ] && [ -x "$DIR/bin/llama-quantize" ]; then
    echo "llama-server already built in $DIR"
    exit 0
fi
for tool in cmake g++; do
    command -v "$tool" >/dev/null || { echo "llama_server_env.sh: $tool is needed (apt-get install cmake g++)" >&2; exit 1; }
done
SRC=$DIR/src
mkdir -p "$SRC"
if [ ! -d "$SRC/llama_cpp_python-$VERSION" ]; then
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
    tar xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
fi
TREE=$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$TREE" -B "$DIR/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$DIR/build" --target llama-server llama-quantize -j "$JOBS"
mkdir -p "$DIR/bin"
cp "$DIR/build/bin/llama-server" "$DIR/build/bin/llama-quantize" "$DIR/bin/"
"$DIR/bin/llama-server" --version 2>&1 | head -2
echo "llama-server built in $DIR/bin"
