#!/usr/bin/env bash
# Builds moekit with CUDA on this (GPU-less) machine and gathers what the GPU machine needs into
# gpu-bundle/ (git-ignored): the binaries and the shared libraries it lacks (oneDNN, OpenCL loader).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-cuda}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=ON -DMOEKIT_BUILD_FUZZ=OFF >/dev/null
cmake --build "$build" -j"$(nproc)"
rm -rf gpu-bundle && mkdir -p gpu-bundle/lib
cp "$build/moekit" "$build/tests/moekit_tests" gpu-bundle/
for lib in libdnnl.so.2 libOpenCL.so.1; do cp -L "/lib/x86_64-linux-gnu/$lib" gpu-bundle/lib/; done
du -sh gpu-bundle
