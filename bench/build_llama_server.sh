#!/usr/bin/env bash
# Build llama.cpp's own server from the llama.cpp that llama-cpp-python vendors, with the same
# CPU flags as the Makefile's llama-cpp-python build, for bench/edge_engine.py --llama-server.
# Output: bench/.peers/llama.cpp/build/bin/llama-server (git-ignored). About 5-10 min on 2 cores.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version="${LLAMA_VERSION:-0.3.36}"
python="${PYTHON:-$here/../.venv/bin/python}"
work="$here/.peers/llama.cpp-src"
out="$here/.peers/llama.cpp"
flags="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}"
mkdir -p "$work"
if [ ! -f "$work/llama_cpp_python-$version.tar.gz" ]; then
  "$python" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work"
fi
rm -rf "$out"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$out"
rm -rf "$work/llama_cpp_python-$version"
# shellcheck disable=SC2086
cmake -S "$out" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $flags
cmake --build "$out/build" --target llama-server -j"$(nproc)"
echo "built $out/build/bin/llama-server"
