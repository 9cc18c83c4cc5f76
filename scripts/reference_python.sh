#!/usr/bin/env bash
# python3 with the reference environment of scripts/setup_reference_env.sh (torch + transformers, CPU).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
env="$root/.refenv"
export PYTHONPATH="$env${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$env/nvidia/cu13/lib:$env/nvidia/cusparselt/lib:$env/nvidia/nccl/lib:$env/nvidia/nvshmem/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec python3 "$@"
