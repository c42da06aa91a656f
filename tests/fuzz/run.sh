#!/usr/bin/env bash
# Fuzz the parsers that read untrusted input with libFuzzer, AddressSanitizer
# and UBSan (needs clang and libinih-dev, not a clang build): the safetensors
# header (tests/embed/st_fuzz.c, its seeds and dictionary; a clang build also
# has it as the ctest entry fuzz_embed_st_header), the serving example's wire
# protocol (fuzz_serve.c) and the INI configuration (fuzz_config.c).
#   tests/fuzz/run.sh [SECONDS_EACH [OUT_DIR]]     (default 60, /tmp/mlart-fuzz)
# SECONDS_EACH 0 only replays the seed inputs, deterministically (CI).  A
# crash, leak, UB report or broken invariant leaves the input in OUT_DIR
# (NAME-crash-*, NAME-leak-*, ...) and fails the run.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
secs=${1:-60}
out=${2:-${TMPDIR:-/tmp}/mlart-fuzz}
mkdir -p "$out"
cc=(clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -I "$src/include" -I "$src")
"${cc[@]}" -o "$out/fuzz_st_header" "$src/tests/embed/st_fuzz.c" "$src/runtime/safetensors.c" \
  "$src/runtime/status.c"
"${cc[@]}" -I "$src/apps/serve-example" -o "$out/fuzz_serve" "$src/tests/fuzz/fuzz_serve.c" \
  "$src/apps/serve-example/serve_proto.c"
"${cc[@]}" -o "$out/fuzz_config" "$src/tests/fuzz/fuzz_config.c" "$src/runtime/config.c" \
  "$src/runtime/status.c" "$src/runtime/tensor.c" -linih

# Seeds: a few valid inputs of each kind (the fuzzer keeps what it finds
# next to them, so a second run goes on from the first).
mkdir -p "$out/corpus_st_header" "$out/corpus_serve" "$out/corpus_config"
cp "$src"/tests/embed/st_fuzz_corpus/* "$out/corpus_st_header/"
# serve: byte 0 sets the line cap, byte 1 where the input is cut in two
# (the harness's context is 100 positions)
printf ' \005{"id": 1, "tokens": 2, "positions": [5, 99]}\n{"id":"abc","tokens":1,"positions":[0]}\r\n\n{"tokens": 3}\n' \
  >"$out/corpus_serve/lines"
printf '\002\000{"id": [1,2], "tokens": 1, "positions": [99]}\n{"id": "\\u0041\\"", "tokens": 64, "positions": [1]}\n' \
  >"$out/corpus_serve/short_cap"
cp "$src"/configs/*.ini "$src"/tests/runtime/*.ini "$out/corpus_config/"

failed=0
for name in st_header serve config; do
  args=(-max_len=4096 -artifact_prefix="$out/$name-" "$out/corpus_$name")
  [ "$name" = st_header ] && args=(-dict="$src/tests/embed/st_fuzz.dict" "${args[@]}")
  if [ "$secs" -gt 0 ]; then
    args=(-max_total_time="$secs" "${args[@]}")
  else
    args=(-runs=0 "${args[@]}")
  fi
  if "$out/fuzz_$name" "${args[@]}" >"$out/$name.log" 2>&1; then
    echo "fuzz_$name: ok ($(grep -hoE 'Done [0-9]+ runs in [0-9]+ second' "$out/$name.log" | tail -n 1 ||
      grep -hoE 'INITED.*corp: [0-9]+' "$out/$name.log" | tail -n 1))"
  else
    echo "fuzz_$name: FAILED (log $out/$name.log)"
    tail -n 30 "$out/$name.log"
    failed=1
  fi
done
exit "$failed"
