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
# The shared libraries the GPU machine lacks, as ldd lists them (oneDNN, the OpenCL loader, ICU and
# PCRE2 for the tokenizer), compressed: together they are larger than a call may carry.
for lib in $(ldd "$build/moekit" "$build/tests/moekit_tests" | grep -oE '/[^ ]*lib(dnnl|OpenCL|icu[a-z]*|pcre2-8)\.so[^ ]*' | sort -u); do
  cp -L "$lib" gpu-bundle/lib/
done
tar -C gpu-bundle -cf - lib | xz -T2 -6 > gpu-bundle/lib.tar.xz
rm -rf gpu-bundle/lib
du -sh gpu-bundle
