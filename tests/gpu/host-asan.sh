#!/usr/bin/env bash
# The host code of the CUDA paths (runtime, layer, backends' host side,
# mlart-decode, the serving example, the GPU tests' C code) under
# AddressSanitizer with leak detection and UBSan, on the GPU machine.  The
# build instruments the C files and links the sanitizer runtimes statically,
# so the GPU machine needs no libasan:
#   san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
#   link="-fsanitize=address,undefined -static-libasan -static-libubsan"
#   cmake -S . -B build-casan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS="$san" \
#     -DCMAKE_EXE_LINKER_FLAGS="$link" -DCMAKE_SHARED_LINKER_FLAGS="$link"
#   cmake --build build-casan -j
# then on the GPU machine:
#   tests/gpu/host-asan.sh build-casan OUT_DIR
# Leaks inside the CUDA driver and libraries are suppressed (they keep
# allocations for the process's life); any other report fails its run.
# Exit status: the number of failed runs.
set -uo pipefail
build=${1:?usage: host-asan.sh BUILD_DIR OUT_DIR}
out=${2:?usage: host-asan.sh BUILD_DIR OUT_DIR}
src=$(cd "$(dirname "$0")/../.." && pwd)
case $build in /*) ;; *) build=$src/$build ;; esac
mkdir -p "$out"
printf 'leak:libcuda.so\nleak:libcudart.so\nleak:libnvidia\nleak:libcublas\n' >"$out/lsan.supp"
export ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1:halt_on_error=1 # CUDA maps the shadow gap
export LSAN_OPTIONS=suppressions=$out/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
dec=$build/apps/mlart-decode/mlart-decode
failed=0 n=0
run() { # command...
  local rc
  n=$((n + 1))
  echo "== $n: $*"
  (cd "$src" && timeout 300 "$@") >"$out/run$n.log" 2>&1
  rc=$?
  grep -hE "ERROR: |SUMMARY: |runtime error|^result:|Checks:" "$out/run$n.log" | head -n 6
  if [ "$rc" -ne 0 ]; then
    echo "== $n FAILED (rc=$rc, log $out/run$n.log)"
    failed=$((failed + 1))
  fi
}
run "$dec" --config configs/deepseek-v32-tp8.ini --device cuda --batch 4 --context 4096 --steps 3 --verify
run "$dec" --config configs/glm5-tp4-dcp4.ini --device cuda --kv-format bf16 --batch 2 --context 4096 --steps 3 \
  --no-graph --verify
run env MLART_B12X_INPLACE=1 "$dec" --config configs/deepseek-v32-tp8.ini --device cuda --batch 2 --context 2048 \
  --steps 2 --set layers=2 --verify
run "$dec" --config configs/deepseek-v32-tp4.ini --device cuda --batch 8 --context 2048 --steps 3 \
  --set early_weights=1
run "$dec" --config configs/tiny-cpu.ini --device cuda --backend reference --steps 3 --verify
run "$build/tests/test_runtime_layer_gpu"
run "$build/tests/attn_kv_write_gpu"
run "$build/tests/attn_backend_gpu"
run "$build/tests/test_embed_serve" "$build/apps/serve-example/mlart-serve-example" --device cuda \
  --config configs/deepseek-v32-tp8.ini --kv-format fp8_ds_mla
echo "== host-asan: $n runs, $failed failed"
exit "$failed"
