#!/usr/bin/env bash
# Build llama.cpp's own C++ server, llama-bench and llama-quantize from the sources vendored in
# the llama-cpp-python sdist (the only llama.cpp source the package registry carries), with the
# host's native flags and no web UI. Nothing is downloaded beyond PyPI.
#
#   bench/llama_cpp/build_peer.sh [DEST]      # DEST defaults to results/llama-cpp
#
# Prints the three binaries' paths at the end. About 10-15 minutes on 2 cores.
#
# On an Intel host with AMX, llama.cpp 0.3.36's AMX weight buffers crash llama-server and
# llama-bench at the first product (a general protection fault in libggml-cpu). Either run the
# native build with `--no-repack` (its plain kernels: no AMX, no repacked K-quant tiles), or build
# with LLAMA_NO_AMX=1: native flags with AMX compiled out, which keeps the repacked tiles (on the
# 2-vCPU Xeon of 2026-12-07 the stronger of the two at decode: llama-bench 1B Q4_K_M tg32 20.0
# against 17.7 tok/s, pp128 146 against 195; docs/benchmarks.md "On an Intel Xeon with AMX").
#
# LLAMA_AVX2_ONLY=1 builds the peer an AVX2-only host would run (no native flags: SSE 4.2, AVX,
# AVX2, FMA, F16C, BMI2; no AVX-512, VNNI or AMX), for the AVX2 tables taken on a host that has
# more (beside ferrox with FERROX_CPU_ISA=avx2; docs/benchmarks.md "AVX2 instruction set").
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DEST=${1:-results/llama-cpp}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
if [ ! -f "$DEST/llama_cpp_python-$VERSION.tar.gz" ]; then
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST"
fi
if [ ! -d "$DEST/src" ]; then
  mkdir -p "$DEST/src"
  tar -xzf "$DEST/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src" --strip-components=1
fi
# GCC lets an explicit -mno-* win over -march=native's implied flags, whatever the order
NO_AMX_FLAGS=()
if [ "${LLAMA_NO_AMX:-0}" = 1 ]; then
  NO_AMX_FLAGS=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
ISA_FLAGS=(-DGGML_NATIVE=ON)
if [ "${LLAMA_AVX2_ONLY:-0}" = 1 ]; then
  ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
             -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
             -DGGML_AMX_BF16=OFF)
fi
cmake -S "$DEST/src/vendor/llama.cpp" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release \
  "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_WEBUI=OFF ${NO_AMX_FLAGS[@]+"${NO_AMX_FLAGS[@]}"} >"$DEST/cmake.log"
cmake --build "$DEST/build" -j "$(nproc)" --target llama-server llama-bench llama-quantize >"$DEST/build.log"
for b in llama-server llama-bench llama-quantize; do
  ls "$DEST/build/bin/$b"
done
