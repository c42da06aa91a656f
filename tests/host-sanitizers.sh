#!/usr/bin/env bash
# The host build (no CUDA) and its tests under AddressSanitizer (with leak
# detection) and UndefinedBehaviorSanitizer; any report fails the run:
#   tests/host-sanitizers.sh [BUILD_DIR]     (default: build-asan)
# test_embed_install is left out: it links a separate project against the
# installed static library, which would need the sanitizers' runtimes too.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-asan}
san="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B "$build" -DMLART_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" -DCMAKE_SHARED_LINKER_FLAGS="$san"
cmake --build "$build" -j
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$build" --output-on-failure --no-tests=error -E '^test_embed_install$'
