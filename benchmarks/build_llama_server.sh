#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU only, Release, that one target) from the llama.cpp source vendored in the
# llama-cpp-python sdist, for benchmarks/llama_server_bench.py. A benchmark step: never part of set-up or CI, and
# nothing of llama.cpp is committed to cairn.
#
#   benchmarks/build_llama_server.sh [SDIST.tar.gz|-] [WORK_DIR]
#
# SDIST: llama_cpp_python-*.tar.gz; "-" or absent: downloaded with
#   pip download --no-deps --no-binary :all: llama-cpp-python
# WORK_DIR (default /work/llama): the sdist is extracted there and built in WORK_DIR/build. Prints the path of
# llama-server last. The sdist has no git metadata, so `llama-server --version` says "version: 0 (unknown)": the
# sdist's version names the llama.cpp it vendors.
set -euo pipefail

sdist="${1:--}"
work="${2:-/work/llama}"
mkdir -p "$work"
if [ "$sdist" = "-" ]; then
    pip download --no-deps --no-binary :all: -d "$work" llama-cpp-python
    sdist="$(ls -t "$work"/llama_cpp_python-*.tar.gz | head -1)"
fi
tar -xzf "$sdist" -C "$work"
src="$work/$(basename "$sdist" .tar.gz)/vendor/llama.cpp"

nice -n 10 cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
nice -n 10 cmake --build "$work/build" --target llama-server -j2
echo "$work/build/bin/llama-server"
