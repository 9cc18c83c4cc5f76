#!/usr/bin/env bash
# Builds moekit as a machine without nvcc does (-DMOEKIT_CUDA=OFF) in build-nocuda/ and runs the main job
# there (the built-in model's generation) and the CPU test suite, so that a CUDA-only dependency cannot
# slip into the portable code unseen: CI's machine has nvcc, so its main build always takes the CUDA path.
# The fuzzers are left to the main build. Extra arguments go to cmake's configure.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cmake -S . -B build-nocuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=OFF -DMOEKIT_BUILD_FUZZ=OFF "$@" >/dev/null
cmake --build build-nocuda -j"$(nproc)"
./build-nocuda/moekit backends --device cuda | grep -q "no CUDA support" || {
  echo "build_without_cuda: 'moekit backends --device cuda' does not say the build has no CUDA" >&2
  exit 1
}
./build-nocuda/moekit generate --max-new-tokens 8
ctest --test-dir build-nocuda --output-on-failure
