#!/usr/bin/env bash
# Installs torch 2.11 and transformers 5.17 (the versions on the GPU machine) into .refenv/ (git-ignored)
# so that test fixtures can be made on this CPU machine. A yardstick for tests only: moekit never
# depends on them. The CUDA libraries torch loads at import come from the CUDA toolkit and a few
# NVIDIA wheels; no GPU is used.
set -euo pipefail
cd "$(dirname "$0")/.."
env=.refenv
if [ ! -d "$env/torch" ]; then
  python3 -m pip install -q --target "$env" --no-deps "torch==2.11.0"
  python3 -m pip install -q --target "$env" typing_extensions sympy networkx jinja2 fsspec filelock numpy \
    "transformers==5.17.0" "cuda-toolkit[cufile]==13.0.2" "nvidia-cusparselt-cu13==0.8.0" \
    "nvidia-nccl-cu13==2.28.9" "nvidia-nvshmem-cu13==3.4.5"
fi
# accelerate: transformers needs it to load pre-quantised (FP8) checkpoints (make_fp8_fixtures.py).
if [ ! -d "$env/accelerate" ]; then
  python3 -m pip install -q --target "$env" --no-deps "accelerate==1.15.0" "psutil==7.2.2"
fi
echo "reference environment ready in $env (use scripts/reference_python.sh)"
