#!/usr/bin/env bash
# Builds moekit with CUDA on this (GPU-less) machine and gathers what the GPU machine needs into
# gpu-bundle/ (git-ignored): the binaries and the shared libraries it lacks (oneDNN, OpenCL loader).
# BASELINE=<git revision> also builds that revision's moekit (a git worktree and build directory under
# build-baseline/, kept for incremental rebuilds) into gpu-bundle/moekit_baseline.xz, which
# `scripts/gpu_check.sh ab` times against this tree's binary in one lease.
# VARIANTS="name:patch[,patch...][:cmake arguments];..." also builds, for each variant, this repository's HEAD
# with those patches applied (a git worktree and build directory under build-variants/name/, kept for
# incremental rebuilds; uncommitted changes are not in it) into gpu-bundle/moekit_name.xz and
# gpu-bundle/moekit_tests_name.xz: `gpu_check.sh ab` times it as side `name` with AB_BINARIES=name, and its
# tests run on the GPU machine after `xz -dc`. Example: VARIANTS="turns:/tmp/turns.patch;
# trace:/tmp/turns.patch:-DCMAKE_CUDA_FLAGS=-DMOEKIT_HOPPER_TRACE=1".
# VARIANTS_IN_TREE=1 builds the variants in this tree's build directory instead: each variant's patches are applied
# to the working tree (which must not differ from HEAD in tracked files), its two targets rebuilt, the patches
# reverted, and this tree rebuilt at the end. Incremental builds (minutes on a fresh checkout, where each worktree
# is a full build); cmake arguments are refused there (they would reconfigure the build directory).
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
# The tests binary compressed too (21 MB -> 3), so that variants fit in what a call may carry;
# gpu_check.sh unpacks it (or: xz -dc gpu-bundle/moekit_tests.xz > gpu-bundle/moekit_tests).
xz -T2 -f gpu-bundle/moekit_tests
# vLLM's Triton kernel source and configurations for scripts/compare_vllm.py, where scripts/fetch_vllm_kernel.sh
# fetched them (about 300 KB).
if [[ -f .deps/vllm-kernel/fused_moe.py ]]; then cp -r .deps/vllm-kernel gpu-bundle/vllm; fi
# A git worktree at revision $2 in directory $1/src (created, or reset and moved there), for BASELINE and VARIANTS.
checkout_worktree() {
  if [[ -d $1/src ]]; then
    git -C "$1/src" reset -q --hard
    git -C "$1/src" checkout -q --detach "$2"
  else
    git worktree add -q --detach "$1/src" "$2"
  fi
}
# Configures $1/src into $1/build as this tree is configured (extra cmake arguments in $3) and builds targets $2.
build_worktree() {
  # shellcheck disable=SC2086
  cmake -S "$1/src" -B "$1/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=ON -DMOEKIT_BUILD_FUZZ=OFF \
    -DMOEKIT_CUTLASS_INCLUDE="$PWD/.deps/cutlass-4.2.0.0/include" ${3:-} >/dev/null
  # shellcheck disable=SC2086
  cmake --build "$1/build" -j"$(nproc)" --target $2
}
if [[ -n ${BASELINE:-} ]]; then
  rev=$(git rev-parse --verify "${BASELINE}^{commit}")
  checkout_worktree build-baseline "$rev"
  build_worktree build-baseline moekit
  xz -T2 -c build-baseline/build/moekit >gpu-bundle/moekit_baseline.xz
  git log -1 --format='%h %s' "$rev" | cut -c1-100 >gpu-bundle/baseline_revision
  echo "baseline: $(cat gpu-bundle/baseline_revision)"
fi
# Reverts the patches named in the array `applied`, last first (VARIANTS_IN_TREE).
revert_applied() {
  local i
  for ((i = ${#applied[@]} - 1; i >= 0; i--)); do git apply -R "${applied[$i]}"; done
  applied=()
}
if [[ -n ${VARIANTS:-} ]]; then
  in_tree=${VARIANTS_IN_TREE:-0}
  head=$(git rev-parse --verify HEAD)
  if [[ $in_tree == 1 ]]; then
    if ! git diff --quiet HEAD; then
      echo "VARIANTS_IN_TREE: tracked files differ from HEAD; commit or stash them" >&2
      exit 2
    fi
    applied=()
    trap revert_applied EXIT  # the working tree is restored however the script ends
  fi
  IFS=';' read -ra specs <<<"$VARIANTS"
  for spec in "${specs[@]}"; do
    IFS=':' read -r name patches extra <<<"$spec"
    [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || { echo "VARIANTS: '$name' is not a name of letters, digits, - and _" >&2; exit 2; }
    IFS=',' read -ra list <<<"$patches"
    if [[ $in_tree == 1 ]]; then
      if [[ -n ${extra:-} ]]; then
        echo "VARIANTS_IN_TREE: variant $name has cmake arguments; build it in a worktree" >&2
        exit 2
      fi
      for patch in "${list[@]}"; do
        git apply "$patch" || { echo "VARIANTS: $patch does not apply to HEAD ($name)" >&2; exit 2; }
        applied+=("$patch")
      done
      cmake --build "$build" -j"$(nproc)" --target moekit moekit_tests
      built=$build how="(in tree)"
    else
      dir="build-variants/$name"
      checkout_worktree "$dir" "$head"
      for patch in "${list[@]}"; do
        git -C "$dir/src" apply "$PWD/$patch" || { echo "VARIANTS: $patch does not apply to HEAD ($name)" >&2; exit 2; }
      done
      build_worktree "$dir" "moekit moekit_tests" "${extra:-}"
      built=$dir/build how=${extra:-}
    fi
    xz -T2 -c "$built/moekit" >"gpu-bundle/moekit_$name.xz"
    xz -T2 -c "$built/tests/moekit_tests" >"gpu-bundle/moekit_tests_$name.xz"
    if [[ $in_tree == 1 ]]; then revert_applied; fi
    echo "variant $name: $(git log -1 --format=%h "$head") + ${patches} ${how}" | tee -a gpu-bundle/variants
  done
  if [[ $in_tree == 1 ]]; then cmake --build "$build" -j"$(nproc)"; fi  # this tree's build directory back to HEAD
fi
du -sh gpu-bundle
