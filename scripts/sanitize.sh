#!/usr/bin/env bash
# The CPU build under AddressSanitizer and UndefinedBehaviorSanitizer (build-sanitize/, no CUDA, no fuzzers:
# they have their own sanitizers), then the whole test suite with any report fatal. The build takes about
# half an hour on 2 cores. Arguments go to ctest (say -R Tokenizer for a part of the suite).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEKIT_CUDA=OFF -DMOEKIT_BUILD_FUZZ=OFF \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" >/dev/null
cmake --build build-sanitize -j"$(nproc)"
# OpenMP's runtime keeps its thread pool to the end of the process, which LeakSanitizer reads as leaks;
# halt_on_error makes every ASan report a test failure.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
ctest --test-dir build-sanitize --output-on-failure "$@"
