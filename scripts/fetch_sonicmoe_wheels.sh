#!/usr/bin/env bash
# Downloads SonicMoE (PyPI sonic-moe 0.1.2) and the packages it needs that the GPU machine lacks, as wheels for
# CPython 3.12 manylinux x86_64 (the GPU machine's Python), installs them into one folder and packs that folder
# into .whl/sonicmoe-site.tar.xz (git-ignored), for scripts/compare_sonicmoe.py on the GPU machine. SonicMoE is
# measured there, never a dependency of moekit: nothing else installs or imports it.
#
# Why a packed folder rather than the wheels: the CuTe DSL's library wheel alone (nvidia-cutlass-dsl-libs-cu13,
# a 151 MB compiler library) is 78 MB, more than one device call may carry (64 MiB with the working tree). Its
# files xz-compress to about 53 MiB with the rest. That still leaves no room for gpu-bundle/ in the same call;
# docs/compare_transformers.md ("SonicMoE") says how to run both sides on one machine.
#
# Usage: scripts/fetch_sonicmoe_wheels.sh   (downloads are kept in .deps/sonicmoe-wheels/ for the next run)
set -euo pipefail
cd "$(dirname "$0")/.."
cache=.deps/sonicmoe-wheels
site=.deps/sonicmoe-site
out=.whl/sonicmoe-site.tar.xz

# Pinned: sonic-moe 0.1.2 pins nvidia-cutlass-dsl 4.4.2 and needs quack-kernels >= 0.3.11; quack-kernels 0.3.11
# needs apache-tvm-ffi >= 0.1.6, < 0.2 and torch-c-dlpack-ext (the versions below are those current for it). The
# DSL's libraries in their CUDA 13 build, as the GPU machine runs CUDA 13 (torch cu130, cuda-bindings 13): that
# wheel holds every file of the CUDA 12 build (nvidia-cutlass-dsl-libs-base, which its metadata also asks for) and
# a few more, so the base wheel is left out. Left out too, being on the GPU machine already: torch, triton, numpy,
# typing-extensions, cuda-bindings (what "cuda-python" provides), packaging. sonic-moe 0.1.2 declares
# torch <= 2.9.1; the GPU machine's torch 2.11 is used regardless (no dependency is resolved here).
packages=(
  sonic-moe==0.1.2
  quack-kernels==0.3.11
  nvidia-cutlass-dsl==4.4.2
  nvidia-cutlass-dsl-libs-cu13==4.4.2
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
)
target=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$cache" "$(dirname "$out")"
python3 -m pip download -q --no-deps "${target[@]}" -d "$cache" "${packages[@]}"
rm -rf "$site"
# From the downloads only (--no-index), each package as pinned. The Python here may not be 3.12, hence
# --ignore-requires-python: the folder is for the GPU machine's 3.12, never imported here.
python3 -m pip install -q --no-deps --no-compile --no-index --find-links "$cache" --ignore-requires-python \
  "${target[@]}" --target "$site" "${packages[@]}"
echo "installed into $site: $(du -sh "$site" | cut -f1)"
tar -C "$(dirname "$site")" -cf - "$(basename "$site")" | xz -T2 -9 >"$out.tmp"
mv "$out.tmp" "$out"
size=$(stat -c %s "$out")
echo "wrote $out: $((size >> 20)) MiB (a device call carries at most 64 MiB, the working tree included)"
cat <<EOF
On the GPU machine (device tool: carry [".whl"]), unpack it into a git-ignored folder, which stays there while the
machine is kept warm:
  mkdir -p .deps && tar -C .deps -xJf $out
  PYTHONUNBUFFERED=1 python3 scripts/compare_sonicmoe.py --sonicmoe-site .deps/sonicmoe-site --out \$OUT/sonicmoe
EOF
