#!/usr/bin/env bash
# Installs the dependencies (scripts/setup.sh) and builds moekit in build/ (Release). CUDA code is
# compiled where nvcc exists (it runs only where a GPU does). Extra arguments go to cmake's configure.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j"$(nproc)"
