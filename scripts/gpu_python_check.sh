#!/usr/bin/env bash
# On the GPU machine: installs this build's wheel (carried as build/dist) into a scratch directory, runs the
# Python package's tests on CUDA, then scripts/bench_transformers.py with the given arguments.
#   scripts/gpu_python_check.sh [--no-tests] [bench_transformers.py arguments]   (results under $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/moekit-out}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-deps --disable-pip-version-check --target "$site" build/dist/moekit-*-py3-none-linux_x86_64.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
if [[ ${1:-} == --no-tests ]]; then
  shift
else
  # The whole log under $OUT, its end here; a failing test does not stop the benchmark.
  (cd python/tests && python3 -m unittest ${MOEKIT_TESTS:-test_torch_op test_transformers}) >"$out/python_tests.txt" 2>&1 || true
  tail -n 40 "$out/python_tests.txt"
fi
python3 scripts/bench_transformers.py --out "$out/bench_transformers.json" "$@" 2>&1 | tee "$out/bench_transformers.txt"
