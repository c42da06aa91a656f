#!/bin/sh
# Run the ops GPU tests and the ops benchmark from a build folder, each under
# a time limit; logs and JSON go to OUTDIR.
#   tests/gpu/ops_run.sh BUILD_DIR OUTDIR [mlart-bench args...]
set -u
build=$1
out=$2
shift 2
mkdir -p "$out"
status=0

run() { # name limit command...
    name=$1
    limit=$2
    shift 2
    echo "== $name"
    start=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    grep -E "^(ops_|query_bmm|v_up_bmm|forced|graph|bad|guard|harness|cuBLAS guard|[0-9]+%:)|:[EF]:|FAULT|died" \
        "$out/$name.log" | head -40
    echo "== $name exit $rc ($(( $(date +%s) - start )) s)"
    [ $rc -eq 0 ] || status=1
}

run ops_guard_gpu 300 "$build/tests/ops_guard_gpu"
run bench 150 "$build/apps/mlart-bench/mlart-bench" --json "$out/bench.json" "$@"
grep -E "^# (mlart|NVIDIA|device)|geomean|worst|wrong results" "$out/bench.log"
run ops_guard_cublas 60 "$build/tests/ops_guard_cublas"
run ops_bmm_gpu 240 "$build/tests/ops_bmm_gpu"
exit $status
