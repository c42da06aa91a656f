#!/usr/bin/env bash
# Pack a build folder for the GPU machine (what travels there is limited to
# 64 MiB): strip executables, drop objects, static archives and CMake's own
# files, and write BUILD_DIR-carry/build.txz (xz: about 7 MiB where gzip gave
# 58).  Carry that folder and unpack it in the checkout there
# (`tar xJf BUILD_DIR-carry/build.txz`); the unpacked
# folder runs every test and the bench.  Run `cmake -S . -B BUILD_DIR`
# afterwards to build here again.
#   tests/gpu/pack.sh BUILD_DIR
set -euo pipefail
build=${1:?usage: pack.sh BUILD_DIR}
build=${build%/}
find "$build" -type f \( -name '*.o' -o -name '*.a' \) -delete
find "$build" -type d -name CMakeFiles -prune -exec rm -rf {} +
find "$build" -type f -perm -u+x -exec sh -c \
  'for f; do head -c4 "$f" | grep -q ELF && strip "$f"; done' sh {} +
mkdir -p "$build-carry"
tar cf - "$build" | xz -9e -T0 > "$build-carry/build.txz"
du -sh "$build" "$build-carry/build.txz"
