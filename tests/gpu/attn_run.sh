#!/bin/sh
# Run the attention GPU tests and the attention bench on the GPU machine:
#   tests/gpu/attn_run.sh BUILD_DIR OUT_DIR [bench args...]
# Logs: OUT_DIR/attn_{kv_write,backend,bench}.log, OUT_DIR/attn_bench.json.
# The tests read their data from the source tree the build was configured
# in (MLART_TEST_DATA, default /work/main/tests/data); when that tree is
# absent here, it is linked to this checkout.
SRC=${MLART_SOURCE_DIR:-/work/main}
set -u
B=${1:?build dir}
O=${2:?out dir}
shift 2
mkdir -p "$O"
if [ ! -e "$SRC" ]; then
    mkdir -p "$(dirname "$SRC")" && ln -s "$PWD" "$SRC"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv >"$O/attn_gpu.txt" 2>&1
cat "$O/attn_gpu.txt"
timeout 40 "$B/tests/attn_kv_write_gpu" >"$O/attn_kv_write.log" 2>&1
echo "attn_kv_write_gpu rc=$?"
timeout 110 "$B/tests/attn_backend_gpu" >"$O/attn_backend.log" 2>&1
echo "attn_backend_gpu rc=$?"
grep -E "^attn|sweep|awkward|graph|bad input|kv_write|Checks|:[EF]:" "$O/attn_kv_write.log" "$O/attn_backend.log" | cut -c1-300
timeout 130 "$B/apps/mlart-bench/mlart-bench" --filter attn --json "$O/attn_bench.json" "$@" >"$O/attn_bench.log" 2>&1
echo "mlart-bench attn rc=$?"
grep -v "^  qbmm\|^  v_up" "$O/attn_bench.log" | tail -70
