#!/usr/bin/env bash
# Checks the sm_90a SASS of a CUDA build of moekit (issue 6: hot kernels without local memory, wgmma in the
# Hopper GEMM):
#   - no kernel uses local memory (LDL / STL: spilled registers, or arrays the compiler could not keep in
#     registers), except the kernels listed in `known` below, each with its reason;
#   - the Hopper grouped GEMM kernels are there and contain HGMMA (bf16/f16) and QGMMA (FP8), issued in
#     batches: a kernel with as many WARPGROUP.ARRIVE as wgmma instructions had its wgmma pipeline serialised
#     by ptxas (its C7511 / C7515 "Potential Performance Loss" notes: too few registers, or accumulators
#     written by other instructions inside the pipeline), each wgmma waited for alone.
# Usage: scripts/check_local_memory.sh BINARY
# Exit status: 0 clean; 1 a kernel outside the list uses local memory, or the Hopper kernels lack their
# wgmma or have it serialised (each named); 77 no cuobjdump here (scripts/fetch_sass_tools.sh fetches it): skipped.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
binary=${1:?usage: scripts/check_local_memory.sh BINARY}
[[ -x "$root/.deps/sass-tools/bin/cuobjdump" ]] && export PATH="$root/.deps/sass-tools/bin:$PATH"
if ! command -v cuobjdump >/dev/null; then
  echo "check_local_memory: skipped, no cuobjdump (scripts/fetch_sass_tools.sh fetches it)"
  exit 77
fi

# Kernels allowed local memory for now (extended regular expressions over the mangled names), and why.
known=(
  # FP4 decode on the tensor cores: a chunk's 64 registers of weights and 16 of scale codes at the
  # 128-register limit (4 and 20 bytes spilled).
  'batched_mm_quantized_tensor_core_cu_[0-9a-f]+[0-9]+(up|down)_kernelI.*WeightFormatE2E'
  # The model runtime's 2-token gemv: ptxas keeps 64 registers and reloads one value per loop iteration.
  'model_linear_cu_[0-9a-f]+[0-9]+gemv_kernelI.*Li2ELb1E'
  # Rotary embedding: the slow path of sinf / cosf for large angles (Payne-Hanek reduction).
  'model_attention_cu_[0-9a-f]+[0-9]+rotary_kernelI'
)

counts=$("$root/scripts/sass_counts.sh" "$binary" .)
kernels=$(grep -c . <<<"$counts" || true)
if ((kernels < 50)); then
  echo "check_local_memory: only $kernels kernels with sm_90a code in $binary; is it a CUDA build?" >&2
  exit 1
fi

# A kernel's counts (sass_counts.sh's NAME=value fields) into `count`, by name, in whatever order they come.
declare -A count
read_counts() {
  count=()
  local field
  for field in $1; do count[${field%%=*}]=${field#*=}; done
}

status=0
while read -r name fields; do
  read_counts "$fields"
  local_accesses=${count[LDL/STL]}
  ((local_accesses == 0)) && continue
  allowed=0
  for pattern in "${known[@]}"; do
    [[ $name =~ $pattern ]] && allowed=1 && break
  done
  if ((allowed)); then
    echo "known: $name: $local_accesses local-memory instructions"
  else
    echo "FAILED: $name uses local memory ($local_accesses LDL/STL instructions)" >&2
    status=1
  fi
done <<<"$counts"

# The Hopper GEMM: every instantiation has wgmma, the FP8 ones (GemmConfig's last argument, kFp8, true: ...Lb1EEEEEv)
# QGMMA.
gemms=$(grep -E '^_ZN6moekit4cuda6hopper19grouped_gemm_kernel' <<<"$counts" || true)
if [[ -z $gemms ]]; then
  echo "FAILED: no hopper::grouped_gemm_kernel in $binary" >&2
  status=1
fi
while read -r name fields; do
  [[ -z $name ]] && continue
  read_counts "$fields"
  if [[ $name =~ Lb1E+v ]]; then
    ((count[QGMMA] == 0)) && echo "FAILED: $name (FP8) has no QGMMA" >&2 && status=1
  else
    ((count[HGMMA] == 0)) && echo "FAILED: $name has no HGMMA" >&2 && status=1
  fi
  wgmma=$((count[HGMMA] + count[QGMMA])) arrive=${count[ARRIVE]}
  if ((wgmma > 0 && arrive >= wgmma)); then
    echo "FAILED: $name has its wgmma serialised ($arrive batches for $wgmma wgmma instructions)" >&2
    status=1
  fi
done <<<"$gemms"

echo "check_local_memory: $kernels kernels, $(grep -c . <<<"$gemms") Hopper GEMM instantiations checked"
exit "$status"
