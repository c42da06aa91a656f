#!/usr/bin/env bash
# compute-sanitizer over the attention kernels, for the GPU machine:
#   tests/gpu/sanitize.sh BUILD_DIR OUT_DIR [TIME_BUDGET_S]
# BUILD_DIR should be a racecheck build (cmake -S . -B build-rc
# -DCMAKE_CUDA_FLAGS=-DB12X_RACECHECK): racecheck cannot follow the stage
# hand-overs by bar.arrive, and that build adds the barriers that let it
# (docs/attention.md, Checking).  Runs racecheck, synccheck and memcheck on
# mlart-decode steps that take each kernel family (16 heads a rank: the
# small-head kernel at one block a chunk and with its stages reused, the
# register-conversion kernel for fp8 at T >= 8, the column halves at T = 1;
# 64 heads a rank at batch 2 and 128 at batch 1: the small-head kernel in
# 16-row tiles (8 tiles over the step's tokens); 64 heads at batch 4 and
# 128 at batch 2: the wgmma kernel), each with --verify, once with full
# top-k lists (context 2048) and once with short requests (context 300:
# lists mostly -1, so the chunks compact their slots), and on
# the test cases of the column halves (racecheck), the wgmma kernel
# (memcheck; racecheck on that case takes over 300 s) and the random steps
# (memcheck), and the layer test (memcheck).  One log per run in
# OUT_DIR; prints a line per run (errors or hazards counted from the
# tool's summary, and whether the backend's launch log named the kernel
# the run is for) and exits non-zero when any run failed, reported an
# error or hazard, took another kernel, or did not finish in time.
set -uo pipefail
build=${1:?usage: sanitize.sh BUILD_DIR OUT_DIR [TIME_BUDGET_S]}
out=${2:?usage: sanitize.sh BUILD_DIR OUT_DIR [TIME_BUDGET_S]}
budget=${3:-540}
src=$(cd "$(dirname "$0")/../.." && pwd)
case $build in /*) ;; *) build=$src/$build ;; esac
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ ! -x "$cs" ]; then
  echo "sanitize.sh: no compute-sanitizer" >&2
  exit 2
fi
export MLART_TEST_DATA=${MLART_TEST_DATA:-$src/tests/data}
mkdir -p "$out"
start=$(date +%s)
failed=0

run() { # name tool limit want command...
  # want: a grep -E pattern that the backend's launch log (MLART_LOG=debug,
  # one line a launch) must match, so that each run is known to have taken
  # the kernel family it is meant to check; - for none
  local name=$1 tool=$2 limit=$3 want=$4 rc left found kern=""
  shift 4
  left=$((budget - ($(date +%s) - start)))
  if [ "$left" -lt 20 ]; then
    printf '%-34s NOT RUN (time budget spent)\n' "$name"
    failed=$((failed + 1))
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  MLART_LOG=debug timeout "$limit" "$cs" --tool "$tool" --error-exitcode 9 "$@" >"$out/$name.log" 2>&1
  rc=$?
  found=$(grep -hoE '(ERROR|RACECHECK) SUMMARY: [0-9]+ (errors|hazards? displayed)' "$out/$name.log" | tail -n 1)
  if [ "$want" != - ]; then
    if grep -qE -- "$want" "$out/$name.log"; then
      kern=", kernel seen"
    else
      kern=", NO launch matching '$want'"
      [ "$rc" -eq 0 ] && rc=8
    fi
  fi
  printf '%-34s rc=%-3d %s%s\n' "$name" "$rc" "${found:-no summary}" "$kern"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

dec=("$build/apps/mlart-decode/mlart-decode" --config "$src/configs/deepseek-v32-tp8.ini" --device cuda
     --steps 1 --verify)
tiles='kernel=b12x_small(_rc)?_kernel \(16-row tiles\)'
wgmma='kernel=b12x_wgmma_kernel \(64-head tiles\)'
for tool in racecheck synccheck memcheck; do
  for fmt in bf16 fp8_ds_mla; do
    for ctx in 2048 300; do
      # context 300 < top-k 2048: each list is 300 positions and 1748 -1s,
      # so the chunks past them compact (b12x::resolve_slots)
      [ "$ctx" = 2048 ] && sfx= || sfx=_c$ctx
      [ "$fmt" = bf16 ] && b16=b12x_small_kernel || b16=b12x_small_rc_kernel
      run "${tool}_h16_${fmt}_b1$sfx" "$tool" 90 'kernel=b12x_small_kernel \(one tile, column halves\)' \
        "${dec[@]}" --kv-format "$fmt" --context "$ctx" --batch 1
      run "${tool}_h16_${fmt}_b16$sfx" "$tool" 120 "kernel=$b16 \\(one tile\\)" \
        "${dec[@]}" --kv-format "$fmt" --context "$ctx" --batch 16
      run "${tool}_tiles_h64_${fmt}_b2$sfx" "$tool" 120 "$tiles" \
        "${dec[@]}" --kv-format "$fmt" --context "$ctx" --batch 2 --set tp_size=2
      run "${tool}_tiles_h128_${fmt}_b1$sfx" "$tool" 120 "$tiles" \
        "${dec[@]}" --kv-format "$fmt" --context "$ctx" --batch 1 --set tp_size=1
      run "${tool}_h64_${fmt}_b4$sfx" "$tool" 120 "$wgmma" \
        "${dec[@]}" --kv-format "$fmt" --context "$ctx" --batch 4 --set tp_size=2
      run "${tool}_h128_${fmt}_b2$sfx" "$tool" 120 "$wgmma" \
        "${dec[@]}" --kv-format "$fmt" --context "$ctx" --batch 2 --set tp_size=1
    done
  done
done
# attn_backend_gpu runs each test in a child process whatever CK_FORK says
# (check_run(s, CK_FORK)); compute-sanitizer checks the children too.
CK_RUN_CASE=half run racecheck_case_half racecheck 120 - "$build/tests/attn_backend_gpu"
CK_RUN_CASE=wgmma run memcheck_case_wgmma memcheck 180 - "$build/tests/attn_backend_gpu"
# 48 steps drawn afresh over heads, T, top-k, list shapes and kernel modes
CK_RUN_CASE=random run memcheck_case_random memcheck 120 - "$build/tests/attn_backend_gpu"
# the layer step's cases (absorption, attention, V up-projection, the KV
# write, the graph cache); its early_weights case needs a dependent kernel
# to start early to test its order, which it does not under the sanitizer,
# so there it checks that step's accesses only
MLART_TEST_UNDER_SANITIZER=1 run memcheck_layer memcheck 180 - "$build/tests/test_runtime_layer_gpu"
echo "== $((failed)) failed, $(($(date +%s) - start)) s"
exit "$failed"
