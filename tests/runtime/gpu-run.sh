#!/usr/bin/env bash
# Runtime checks on a CUDA machine, from a build folder made elsewhere:
#   tests/runtime/gpu-run.sh BUILD_DIR OUT_DIR
# Runs the layer's device test and mlart-decode on the device (default backend
# and reference, both KV formats, --verify against the float64 oracle, the
# steps replayed from a CUDA graph (the default) and launched directly
# (--no-graph) giving the same bytes; a DCP group as threads (local
# communicator); the NCCL communicator's test, alone and under mpirun -np 1;
# steps with the in-place combine, and
# compute-sanitizer memcheck on them and a leak check of whole runs when the
# toolkit is installed), and
# writes one log per run into OUT_DIR.  Exit
# status: number of failed runs.
set -uo pipefail
build=${1:?usage: gpu-run.sh BUILD_DIR OUT_DIR}
out=${2:?usage: gpu-run.sh BUILD_DIR OUT_DIR}
src=$(cd "$(dirname "$0")/../.." && pwd)
dec="$build/apps/mlart-decode/mlart-decode"
mkdir -p "$out"
failed=0

run() { # name, command...
  local name=$1
  shift
  echo "== $name: $*" | tee "$out/$name.log"
  if ! "$@" 2>&1 | tee -a "$out/$name.log"; then
    echo "== $name FAILED" | tee -a "$out/$name.log"
    failed=$((failed + 1))
    return 1
  fi
}

# A sanitizer run filtered to one kernel family must also show that the kernel
# ran, or it passes with nothing checked: with MLART_LOG=debug the backend logs
# each launch ("kernel=NAME (WHAT) grid ...", b12x_attend.cu), and the log must
# match PATTERN (grep -E).  run_on name pattern command...
run_on() {
  local name=$1 want=$2
  shift 2
  run "$name" env MLART_LOG=debug "$@" || return
  if ! grep -qE -- "$want" "$out/$name.log"; then
    echo "== $name FAILED: no launch matching '$want' in the log" | tee -a "$out/$name.log"
    failed=$((failed + 1))
  fi
}

run runtime_layer_gpu "$build/tests/test_runtime_layer_gpu"
run decode_tiny_cuda "$dec" --config "$src/configs/tiny-cpu.ini" --device cuda --steps 4 --verify
run decode_tiny_cuda_ref "$dec" --config "$src/configs/tiny-cpu.ini" --device cuda --backend reference --steps 4 --verify
run decode_glm5_verify "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda --batch 8 --context 4096 --steps 4 --verify
# more requests than a cache-fill chunk's 4096 rows: the step's new rows need B-row buffers
run decode_dsv32_batch_over_chunk_verify "$dec" --config "$src/configs/deepseek-v32-tp8.ini" --device cuda \
  --batch 4200 --context 64 --set topk=64 --steps 2 --verify
run decode_dsv32_verify "$dec" --config "$src/configs/deepseek-v32-tp8.ini" --device cuda --batch 8 --context 4096 --steps 4 --verify
run decode_dsv32_direct_verify "$dec" --config "$src/configs/deepseek-v32-tp8.ini" --device cuda --batch 8 --context 4096 --steps 4 --verify --no-graph
run decode_glm5_bf16_verify "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda --kv-format bf16 --batch 4 --context 3000 --steps 2 --verify
# decode-context parallel: glm5's group of 4 ranks as threads on this device (local
# communicator), each rank's 16 heads checked against the float64 oracle over the whole
# cache; then the NCCL communicator and the layer's DCP step over it (a group of one:
# the plain step's bytes, eager and replayed), alone and as rank 0 of 1 under mpirun
run decode_glm5_dcp_local_a2a "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda \
  --batch 8 --context 4096 --steps 3 --verify --dcp-local --set dcp_routing=a2a
run decode_glm5_dcp_local_ag_rs "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda \
  --kv-format bf16 --batch 5 --context 3000 --steps 2 --verify --dcp-local --set dcp_routing=ag_rs \
  --set dcp_interleave=64
# one token a step: attend reads the all-gather's buffer (no head gather)
run decode_glm5_dcp_local_one_token "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda \
  --batch 1 --context 4096 --steps 2 --verify --dcp-local
# validate_indices: every step's indices checked on the host and the ranks' steps compared
# (docs/dcp.md), eagerly; the same outputs
run decode_glm5_dcp_local_validate "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda \
  --batch 4 --context 2048 --steps 2 --verify --dcp-local --set validate_indices=1
run comm_nccl_gpu "$build/tests/test_comm_nccl_gpu"
run dcp_nccl_gpu "$build/tests/test_dcp_nccl_gpu"
if command -v mpirun >/dev/null; then
  mp=(mpirun --allow-run-as-root --oversubscribe)
  run comm_nccl_mpirun "${mp[@]}" -np 1 "$build/tests/test_comm_nccl_gpu"
  run dcp_nccl_mpirun "${mp[@]}" -np 1 "$build/tests/test_dcp_nccl_gpu"
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "$ngpu" -ge 2 ]; then
    # one GPU a rank: the collectives, the layer's DCP step and mlart-decode over NCCL
    n=$((ngpu >= 4 ? 4 : 2))
    run comm_nccl_np$n "${mp[@]}" -np $n "$build/tests/test_comm_nccl_gpu"
    run dcp_nccl_np$n "${mp[@]}" -np $n "$build/tests/test_dcp_nccl_gpu"
    run decode_glm5_dcp_np$n "${mp[@]}" -np $n "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" \
      --device cuda --set heads=$((16 * n)) --set tp_size=$n --set dcp_size=$n --batch 8 \
      --context 4096 --steps 3 --verify
    run decode_glm5_dcp_np${n}_validate "${mp[@]}" -np $n "$dec" \
      --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda --set heads=$((16 * n)) \
      --set tp_size=$n --set dcp_size=$n --batch 4 --context 2048 --steps 2 --verify \
      --set validate_indices=1
    # a rank that leaves: the others' collective ends in an error within 90 s, not a hang
    run comm_nccl_dead_peer_np2 timeout 150 "${mp[@]}" -np 2 "$build/tests/test_comm_nccl_gpu" \
      --dead-peer
  else
    # one GPU: NCCL refuses a group of two ranks on one device; the run must say so and
    # exit non-zero, not hang (mpirun ends the other rank once one fails)
    name=decode_dcp_np2_one_gpu
    echo "== $name: two ranks on one GPU, expecting NCCL's refusal" | tee "$out/$name.log"
    timeout 150 "${mp[@]}" -np 2 "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda \
      --set heads=32 --set tp_size=2 --set dcp_size=2 --steps 1 >>"$out/$name.log" 2>&1
    rc=$?
    if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] ||
       ! grep -q 'Duplicate GPU' "$out/$name.log"; then
      echo "== $name FAILED: rc $rc, want non-zero with a rank naming the duplicate GPU" |
        tee -a "$out/$name.log"
      failed=$((failed + 1))
    else
      echo "== $name: rc $rc, refused: $(grep -m1 'Duplicate GPU' "$out/$name.log")" |
        tee -a "$out/$name.log"
    fi
  fi
fi
# 16 heads a rank at T = 1 and 4, 64 (glm5 heads=256 over tp 4) at T = 4, with the in-place combine
# (opt-in, docs/attention.md; 64 heads at T <= 3 run in 16-row tiles, never in place)
run decode_dsv32_inplace_verify env MLART_B12X_INPLACE=1 "$dec" --config "$src/configs/deepseek-v32-tp8.ini" \
  --device cuda --batch 1 --context 2048 --steps 2 --verify
run decode_dsv32_bf16_inplace_verify env MLART_B12X_INPLACE=1 "$dec" --config "$src/configs/deepseek-v32-tp8.ini" \
  --device cuda --kv-format bf16 --batch 4 --context 2048 --steps 2 --verify
run decode_glm5_inplace_verify env MLART_B12X_INPLACE=1 "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" \
  --device cuda --set heads=256 --batch 4 --context 2048 --steps 2 --verify
# compute-sanitizer memcheck on the in-place kernels (16, 64 and 64 + 36 heads; when the toolkit is there)
san=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
if [ -x "$san" ]; then
  mc=("$san" --tool memcheck --error-exitcode 1)
  run_on memcheck_inplace_small 'kernel=b12x_small_kernel \(one tile\).* in place' \
    env MLART_B12X_INPLACE=1 "${mc[@]}" --kernel-name kns=b12x_small "$dec" \
    --config "$src/configs/deepseek-v32-tp8.ini" --device cuda --batch 2 --context 2048 --steps 1 --verify
  run_on memcheck_inplace_wgmma 'kernel=b12x_wgmma_kernel \(64-head tiles\).* in place' \
    env MLART_B12X_INPLACE=1 "${mc[@]}" --kernel-name kns=b12x_wgmma "$dec" \
    --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda --set heads=256 --batch 4 --context 2048 --steps 1 \
    --verify
  # 100 heads a rank at T = 2 with MLART_B12X_WGMMA=0: both tiles on the general kernel (the default
  # runs that step in 16-row tiles, which never combine in place)
  run_on memcheck_inplace_general 'kernel=b12x_attend_ip_kernel \(last tile\)' \
    env MLART_B12X_INPLACE=1 MLART_B12X_WGMMA=0 "${mc[@]}" --kernel-name kns=b12x_attend "$dec" \
    --config "$src/configs/deepseek-v32-tp8.ini" --device cuda --set heads=800 --batch 2 --context 2048 --steps 1 \
    --verify
  # 16-row tiles on the small-head kernel: 64 heads a rank at T = 2 (bf16: in fp8 its 8 pairs take the
  # register-conversion kernel, which memcheck_tiles_h100 covers) and 32 at T = 1
  run_on memcheck_tiles_h64 'T=2 heads=64 kv=bf16 .*kernel=b12x_small_kernel \(16-row tiles\)' \
    "${mc[@]}" --kernel-name kns=b12x_small "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda \
    --kv-format bf16 --set heads=256 --batch 2 --context 2048 --steps 1 --verify
  run_on memcheck_tiles_h32 'T=1 heads=32 .*kernel=b12x_small_kernel \(16-row tiles\)' \
    "${mc[@]}" --kernel-name kns=b12x_small "$dec" --config "$src/configs/deepseek-v32-tp4.ini" --device cuda \
    --batch 1 --context 2048 --steps 1 --verify
  # 100 heads a rank at T = 6: seven tiles, 42 pairs (fp8: the register-conversion kernel)
  run_on memcheck_tiles_h100 'T=6 heads=100 .*kernel=b12x_small_rc_kernel \(16-row tiles\)' \
    "${mc[@]}" --kernel-name kns=b12x_small "$dec" --config "$src/configs/deepseek-v32-tp8.ini" --device cuda \
    --set heads=800 --batch 6 --context 2048 --steps 1 --verify
  # the V up-projection on the swap path, launched by the layer step with programmatic
  # dependent launch (16 heads a rank at T = 4)
  run memcheck_swap env "$san" --tool memcheck --error-exitcode 1 --kernel-name kns=bmm_swap "$dec" \
    --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda --batch 4 --context 2048 --steps 1 --verify
  # memcheck over every kernel of a whole run, and every device allocation freed by the exit
  # (--leak-check full): steps replayed from a graph with --verify (the reference layers too), and
  # launched directly
  lc=("$san" --tool memcheck --leak-check full --error-exitcode 1)
  run leakcheck_dsv32_graph "${lc[@]}" "$dec" --config "$src/configs/deepseek-v32-tp8.ini" --device cuda \
    --batch 4 --context 4096 --steps 3 --verify
  run leakcheck_glm5_bf16_direct "${lc[@]}" "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda \
    --kv-format bf16 --batch 2 --context 4096 --steps 3 --no-graph
  # a DCP group of 4 as threads, both routings (the translate, gather, combine and scale kernels
  # and attention over 64 heads on each shard), and every allocation of its layers freed
  run leakcheck_glm5_dcp_local_a2a "${lc[@]}" "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" \
    --device cuda --batch 3 --context 2048 --steps 2 --verify --dcp-local --set dcp_routing=a2a \
    --set dcp_interleave=3
  run leakcheck_glm5_dcp_local_ag_rs "${lc[@]}" "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" \
    --device cuda --kv-format bf16 --batch 3 --context 2048 --steps 2 --verify --dcp-local \
    --set dcp_routing=ag_rs
else
  echo "== compute-sanitizer not found: memcheck of the in-place and swap kernels not run"
fi
# two runs with the same arguments plus flags A and flags B give the same checksum over every
# step's output: checksum_eq "FLAGS A" "FLAGS B" mlart-decode arguments...
checksum_eq() {
  local fa=$1 fb=$2 a b
  shift 2
  a=$("$dec" "$@" $fa | grep '^checksum')
  b=$("$dec" "$@" $fb | grep '^checksum')
  echo "${fa:-(default)}: $a"
  echo "$fb: $b"
  [ -n "$a" ] && [ "$a" = "$b" ]
}
# the steps replayed from one captured CUDA graph (the default) give the bytes of the steps
# launched directly (--no-graph), while the lengths grow each step
same_checksum() { checksum_eq "" --no-graph "$@"; }
run graph_eq_dsv32 same_checksum --config "$src/configs/deepseek-v32-tp8.ini" --device cuda \
  --batch 8 --context 2048 --steps 6 --set layers=3
run graph_eq_glm5_bf16 same_checksum --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda \
  --kv-format bf16 --set heads=256 --batch 4 --context 2048 --steps 4
inplace_checksum() { (export MLART_B12X_INPLACE=1 && same_checksum "$@"); }
run graph_eq_dsv32_inplace inplace_checksum --config "$src/configs/deepseek-v32-tp8.ini" --device cuda \
  --batch 2 --context 2048 --steps 4
# early_weights (the query absorption launched with PDL) changes no byte, replayed or launched
# directly, and verifies against the oracle
early_checksum() { checksum_eq "--set early_weights=1" "--set early_weights=0" "$@"; }
run early_eq_dsv32 early_checksum --config "$src/configs/deepseek-v32-tp8.ini" --device cuda \
  --batch 8 --context 2048 --steps 6 --set layers=3
run early_eq_dsv32_direct early_checksum --config "$src/configs/deepseek-v32-tp8.ini" --device cuda \
  --batch 8 --context 2048 --steps 6 --set layers=3 --no-graph
run early_eq_glm5_h64 early_checksum --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda \
  --set heads=256 --batch 4 --context 2048 --steps 4 --set layers=2
run early_eq_dsv32_h128 early_checksum --config "$src/configs/deepseek-v32-tp8.ini" --device cuda \
  --set heads=1024 --batch 4 --context 2048 --steps 4 --set layers=2
run early_eq_dsv32_h128_t16 early_checksum --config "$src/configs/deepseek-v32-tp8.ini" --device cuda \
  --set heads=1024 --batch 16 --context 2048 --steps 2 --set layers=2
run early_eq_glm5_t16 early_checksum --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda \
  --set heads=256 --batch 16 --context 2048 --steps 2 --set layers=2
run decode_glm5_early_verify "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda --batch 8 \
  --context 4096 --steps 4 --set layers=2 --set early_weights=1 --verify
run graph_eq_tiny_ref same_checksum --config "$src/configs/tiny-cpu.ini" --device cuda --backend reference \
  --steps 4
run decode_glm5 "$dec" --config "$src/configs/glm5-tp4-dcp4.ini" --device cuda
run decode_dsv32 "$dec" --config "$src/configs/deepseek-v32-tp8.ini" --device cuda
exit "$failed"
