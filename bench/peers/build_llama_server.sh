#!/usr/bin/env bash
# Build llama.cpp's own OpenAI-compatible server (llama-server: continuous batching over
# parallel slots) from the llama.cpp sources that the llama-cpp-python source distribution on
# PyPI vendors, for this CPU. Takes about ten minutes on 2 cores; needs cmake, a C++ compiler
# and the network (PyPI) once.
#   bash bench/peers/build_llama_server.sh [VERSION]   (llama-cpp-python version, default 0.3.36)
# Result: $PEERS/llama-server/bin/llama-server, PEERS=${PEERS:-$TESSERA_CACHE/peers}
# (TESSERA_CACHE defaults to ~/.cache/tessera).
# Instruction sets: AVX2/FMA/F16C always (the build is not -march=native, so it stays portable
# within one machine's kind), AVX-512 variants where /proc/cpuinfo lists them. AMX stays off:
# ggml's AMX kernels have died with SIGILL on virtual machines whose hypervisor hides AMX state.
set -euo pipefail
VERSION=${1:-0.3.36}
PEERS=${PEERS:-${TESSERA_CACHE:-$HOME/.cache/tessera}/peers}
SRC_ROOT=$PEERS/src
BUILD=$PEERS/llama-server
mkdir -p "$PEERS/downloads" "$SRC_ROOT"
SDIST=$PEERS/downloads/llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEERS/downloads"
fi
[ -d "$SRC_ROOT/llama_cpp_python-$VERSION" ] || tar -xzf "$SDIST" -C "$SRC_ROOT"
SRC=$SRC_ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp
[ -f "$SRC/CMakeLists.txt" ] || { echo "no llama.cpp sources in $SRC" >&2; exit 1; }

has() { grep -qw "$1" /proc/cpuinfo; }
ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
if has avx512f; then
  ISA+=(-DGGML_AVX512=ON)
  has avx512_vnni && ISA+=(-DGGML_AVX512_VNNI=ON)
  has avx512vbmi && ISA+=(-DGGML_AVX512_VBMI=ON)
  has avx512_bf16 && ISA+=(-DGGML_AVX512_BF16=ON)
fi
has avx_vnni && ISA+=(-DGGML_AVX_VNNI=ON)

cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  "${ISA[@]}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
cmake --build "$BUILD" --target llama-server -j "$(nproc)"
"$BUILD/bin/llama-server" --version
