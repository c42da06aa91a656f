#!/usr/bin/env bash
# Every GPU test and the full benchmark in one go, for the GPU machine:
#   tests/gpu/run-all.sh BUILD_DIR OUT_DIR [TIME_BUDGET_S [STEP...]]
# With STEP names (e.g. ops_guard_gpu bench) only those steps run, so that
# the suite can be split over calls shorter than its whole run (about
# 600 s); the summary lists the others as not selected.
# BUILD_DIR was configured in /work/main (absolute paths are baked into the
# tests); when this checkout lives elsewhere, /work/main is linked to it.
# Writes one log per step and bench.json into OUT_DIR, prints a summary and
# exits non-zero when any step failed.
set -uo pipefail
build=${1:?usage: run-all.sh BUILD_DIR OUT_DIR [TIME_BUDGET_S [STEP...]]}
out=${2:?usage: run-all.sh BUILD_DIR OUT_DIR [TIME_BUDGET_S [STEP...]]}
budget=${3:-540}
shift $(($# < 3 ? $# : 3))
only=" $* "
steps="attn_kv_write_gpu attn_backend_gpu test_runtime_layer_gpu serve_gpu ops_guard_gpu ops_guard_cublas decode_runs bench ops_bmm_gpu"
for s in "$@"; do
  case " $steps " in *" $s "*) ;; *) echo "run-all.sh: no step '$s' (steps: $steps)" >&2; exit 2 ;; esac
done
src=$(cd "$(dirname "$0")/../.." && pwd)
if [ ! -e /work/main ]; then
  mkdir -p /work && ln -s "$src" /work/main
fi
case $build in /*) ;; *) build=$src/$build ;; esac
mkdir -p "$out"
start=$(date +%s)
summary=()
failed=0

step() { # name limit command...
  local name=$1 limit=$2 rc t0 left
  shift 2
  if [ "$only" != "  " ] && [[ $only != *" $name "* ]]; then
    summary+=("$(printf '%-26s not selected' "$name")")
    return
  fi
  left=$((budget - ($(date +%s) - start)))
  if [ "$left" -lt 20 ]; then
    summary+=("$(printf '%-26s NOT RUN (time budget spent)' "$name")")
    failed=$((failed + 1))
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  t0=$(date +%s)
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  tail -n 4 "$out/$name.log"
  summary+=("$(printf '%-26s rc=%-3d %4ds' "$name" "$rc" $(($(date +%s) - t0)))")
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
step attn_kv_write_gpu 120 "$build/tests/attn_kv_write_gpu"
step attn_backend_gpu 240 "$build/tests/attn_backend_gpu"
step test_runtime_layer_gpu 90 "$build/tests/test_runtime_layer_gpu"
step serve_gpu 150 ctest --test-dir "$build" --output-on-failure -R test_embed_serve_gpu
step ops_guard_gpu 420 "$build/tests/ops_guard_gpu"
step ops_guard_cublas 60 "$build/tests/ops_guard_cublas"
step decode_runs 240 "$src/tests/runtime/gpu-run.sh" "$build" "$out/decode"
# the bench, then its JSON parsed (where python3 is at hand)
step bench 240 bash -c '"$1" --json "$2" || exit; command -v python3 >/dev/null || exit 0
  python3 -m json.tool "$2" >/dev/null && echo "bench.json: valid JSON"' _ \
  "$build/apps/mlart-bench/mlart-bench" "$out/bench.json"
step ops_bmm_gpu 240 "$build/tests/ops_bmm_gpu"

echo
echo "== summary ($(($(date +%s) - start)) s)"
printf '%s\n' "${summary[@]}"
grep -hE "geomean|worst|wrong results|roofline" "$out/bench.log" 2>/dev/null
exit "$failed"
