#!/usr/bin/env bash
# Installs what moekit needs to build and test on a fresh Debian machine, skipping what is present.
# Idempotent; called by both README commands and by .ci/run.
set -euo pipefail

packages=(
  cmake g++ make ninja-build pkg-config
  libdnnl-dev          # oneDNN: CPU GEMMs
  ocl-icd-opencl-dev   # OpenCL headers and loader: Debian's oneDNN CMake config asks for them
  nlohmann-json3-dev   # JSON (safetensors headers, bench output)
  libcli11-dev         # command-line flags
  libpcre2-dev         # regular expressions of the tokenizers' pre-tokenizers (\p{L}, lookahead)
  libicu-dev           # Unicode normalisation (NFC) and character properties for the tokenizer
  libgtest-dev         # tests
  libbenchmark-dev     # micro-benchmarks
  libomp-dev           # OpenMP runtime for clang (the fuzzer build)
  clang                # libFuzzer target for the safetensors reader
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  as_root=()
  [ "$(id -u)" -eq 0 ] || as_root=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get update -q
  "${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi

# Header-only dependencies fetched by scripts/setup.sh (CUTLASS/CuTe for the Hopper kernels).
"$(dirname "$0")/fetch_cutlass.sh"
# Where CUDA code is built (nvcc found as CMake finds it), cuobjdump for the test that reads the kernels'
# SASS (scripts/check_local_memory.sh).
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  "$(dirname "$0")/fetch_sass_tools.sh" || echo "setup: warning: cuobjdump not fetched; the SASS test will skip" >&2
fi
# torch and transformers (the GPU machine's versions) for the Python package's tests and scripts/python.sh,
# and for making test fixtures; never a dependency of the C++ library.
"$(dirname "$0")/setup_reference_env.sh"
