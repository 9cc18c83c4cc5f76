#!/usr/bin/env bash
# Builds moekit with CUDA on this (GPU-less) machine and gathers what the GPU machine needs into
# gpu-bundle/ (git-ignored): the binaries and the shared libraries it lacks (oneDNN, OpenCL loader).
# BASELINE=<git revision> also builds that revision's moekit (a git worktree and build directory under
# build-baseline/, kept for incremental rebuilds) into gpu-bundle/moekit_baseline.xz, which
# `scripts/gpu_check.sh ab` times against this tree's binary in one lease.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-cuda}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=ON -DMOEKIT_BUILD_FUZZ=OFF >/dev/null
cmake --build "$build" -j"$(nproc)"
rm -rf gpu-bundle && mkdir -p gpu-bundle/lib
cp "$build/moekit" "$build/tests/moekit_tests" "$build/moekit_cuda_stream_read" gpu-bundle/
# The shared libraries the GPU machine lacks, as ldd lists them (oneDNN, the OpenCL loader, ICU and
# PCRE2 for the tokenizer), compressed: together they are larger than a call may carry.
for lib in $(ldd "$build/moekit" "$build/tests/moekit_tests" | grep -oE '/[^ ]*lib(dnnl|OpenCL|icu[a-z]*|pcre2-8)\.so[^ ]*' | sort -u); do
  cp -L "$lib" gpu-bundle/lib/
done
tar -C gpu-bundle -cf - lib | xz -T2 -6 > gpu-bundle/lib.tar.xz
rm -rf gpu-bundle/lib
if [[ -n ${BASELINE:-} ]]; then
  rev=$(git rev-parse --verify "${BASELINE}^{commit}")
  worktree="build-baseline/src"
  if [[ -d $worktree ]]; then
    git -C "$worktree" checkout -q --detach "$rev"
  else
    git worktree add -q --detach "$worktree" "$rev"
  fi
  cmake -S "$worktree" -B build-baseline/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=ON \
    -DMOEKIT_BUILD_FUZZ=OFF -DMOEKIT_CUTLASS_INCLUDE="$PWD/.deps/cutlass-4.2.0.0/include" >/dev/null
  cmake --build build-baseline/build -j"$(nproc)" --target moekit
  xz -T2 -c build-baseline/build/moekit >gpu-bundle/moekit_baseline.xz
  git log -1 --format='%h %s' "$rev" | cut -c1-100 >gpu-bundle/baseline_revision
  echo "baseline: $(cat gpu-bundle/baseline_revision)"
fi
du -sh gpu-bundle
