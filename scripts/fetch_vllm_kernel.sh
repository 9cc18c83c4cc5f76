#!/usr/bin/env bash
# Downloads vLLM's wheel (PyPI vllm 0.33.0, no dependencies) and takes from it what scripts/compare_vllm.py reads on
# the GPU machine: model_executor/layers/fused_moe/fused_moe.py (the source of its Triton fused_moe_kernel) and the
# tuned kernel configurations of the unquantised layer for H100 and H200, into .deps/vllm-kernel/ (git-ignored).
# scripts/make_gpu_bundle.sh copies that folder into gpu-bundle/vllm/. vLLM is measured, never a dependency: nothing
# else reads these files, and none of them is in the repository. Its wheel (336 MB) is more than a device call may
# carry, the pieces taken are about 300 KB.
#
# Usage: scripts/fetch_vllm_kernel.sh   (the wheel is kept in .deps/vllm/ for the next run)
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.33.0
cache=.deps/vllm
out=.deps/vllm-kernel
mkdir -p "$cache"
wheel=$(ls "$cache"/vllm-"$version"-*.whl 2>/dev/null | head -1 || true)
if [[ -z $wheel ]]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "vllm==$version" -d "$cache"
  wheel=$(ls "$cache"/vllm-"$version"-*.whl | head -1)
fi
rm -rf "$out" && mkdir -p "$out/configs"
dir=vllm/model_executor/layers/fused_moe
unzip -p "$wheel" "$dir/fused_moe.py" >"$out/fused_moe.py"
# The bf16 configurations (no dtype= in the name) of the two GPUs the device tool lends.
unzip -Z1 "$wheel" "$dir/configs/*" | grep -E 'device_name=NVIDIA_(H200|H100_80GB_HBM3)\.json$' |
  while read -r f; do unzip -p "$wheel" "$f" >"$out/configs/$(basename "$f")"; done
echo "$wheel" >"$out/source"
echo "vLLM $version's fused_moe.py and $(ls "$out/configs" | wc -l) configurations in $out"
