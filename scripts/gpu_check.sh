#!/usr/bin/env bash
# Runs on the GPU machine in one call: CUDA tests, then moekit's benchmark and transformers'
# backends side by side on the same shapes (scripts/compare_transformers.py). Takes the binaries
# built on the CPU machine by scripts/make_gpu_bundle.sh (carried as gpu-bundle/).
# Usage: scripts/gpu_check.sh [tests|bench|compare|all]   (default all); results under $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${OUT:-gpu-results}
mkdir -p "$out"
export LD_LIBRARY_PATH="$PWD/gpu-bundle/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
status=0
if [[ $what == tests || $what == all ]]; then
  ./gpu-bundle/moekit_tests --gtest_filter='Cuda*:*Cuda*:*Graph*' --gtest_brief=1 2>&1 | tee "$out/cuda_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  ./gpu-bundle/moekit bench --device cuda ${BENCH_ARGS:-} --json "$out/bench_cuda.json" --plot "$out/bench_cuda.svg" 2>&1 | tee "$out/bench_cuda.log"
fi
if [[ $what == compare || $what == all ]]; then
  PYTHONUNBUFFERED=1 python3 scripts/compare_transformers.py --moekit ./gpu-bundle/moekit --out "$out" ${COMPARE_ARGS:-} 2>&1 | tee "$out/compare.log"
fi
exit $status
