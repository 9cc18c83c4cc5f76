#!/usr/bin/env bash
# Builds moekit as a machine without nvcc does (-DMOEKIT_CUDA=OFF) in build-nocuda/ and runs there the main
# job (the built-in model's generation) and the tests of what differs between the two builds, so that a
# CUDA-only dependency cannot slip into the portable code unseen: CI's machine has nvcc, so its main build
# always takes the CUDA path. The fuzzers are left to the main build. Extra arguments go to cmake's configure;
# FULL=1 runs the whole suite instead (as the main build's, only slower on CPUs without AVX-512).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cmake -S . -B build-nocuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=OFF -DMOEKIT_BUILD_FUZZ=OFF "$@" >/dev/null
cmake --build build-nocuda -j"$(nproc)"
backends=$(./build-nocuda/moekit backends --device cuda)
if [[ $backends != *"no CUDA support"* ]]; then
  echo "build_without_cuda: 'moekit backends --device cuda' does not say the build has no CUDA:" >&2
  echo "$backends" >&2
  exit 1
fi
./build-nocuda/moekit generate --max-new-tokens 8
if [[ ${FULL:-0} == 1 ]]; then
  ctest --test-dir build-nocuda --output-on-failure
  exit
fi
# What the builds do differently: device availability and its reasons, the registry and validation that
# read them, the GPU tests' skips, tensors and graphs across devices, the size and memory checks, and the
# command-line tool. The kernels and the model runtime are the same code as in the main build, whose whole
# suite CI runs.
./build-nocuda/tests/moekit_tests --gtest_brief=1 \
  --gtest_filter='Tensor*:Storage*:Device*:Registry*:*Validation*:*Graph*:*Cuda*:UnavailableBackend*:CheckedMath*:AvailableMemory*:UntrustedSizes*'
ctest --test-dir build-nocuda --output-on-failure -R '^cli_'
