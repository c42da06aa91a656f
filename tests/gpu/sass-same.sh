#!/usr/bin/env bash
# Does a change leave the machine code of kernels alone?  Compiles CUDA
# files of a git revision and of the working tree to sm_90a cubins (nvcc
# only, no device) and compares each kernel's .text section byte for byte:
#   tests/gpu/sass-same.sh REV FILE.cu [FILE.cu ...]
# e.g. tests/gpu/sass-same.sh HEAD~1 backends/b12x_mla_sparse/b12x_attend.cu
# Prints one line per kernel: SAME, DIFFERS, GONE (only in REV) or NEW (only
# in the tree); names are compared without the anonymous-namespace hash, and
# a kernel of REV whose name changed but whose bytes did not (a template
# parameter added, say) is SAME with its new name.  SAME is about the
# instructions (.text); a changed .nv.info section (register count,
# parameter sizes, barriers) is reported beside it.  FILE paths are
# relative to the repository root; the flags are the build's but -lineinfo.
# Exit status: 0 when every kernel of REV is SAME, 1 otherwise, 2 on error.
set -euo pipefail
rev=${1:?usage: sass-same.sh REV FILE.cu [FILE.cu ...]}
shift
[ $# -ge 1 ] || { echo "usage: sass-same.sh REV FILE.cu [FILE.cu ...]" >&2; exit 2; }
src=$(cd "$(dirname "$0")/../.." && pwd)
nvcc=${NVCC:-nvcc}
command -v "$nvcc" >/dev/null || { echo "sass-same.sh: no nvcc (set NVCC)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/old"
git -C "$src" archive "$rev" | tar -x -C "$tmp/old" || exit 2
flags=(-cubin -arch=sm_90a -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr)
status=0
for f in "$@"; do
  name=$(echo "$f" | tr '/' '_')
  (cd "$tmp/old" && "$nvcc" "${flags[@]}" -I. -Iinclude "$f" -o "$tmp/$name.old.cubin") || exit 2
  (cd "$src" && "$nvcc" "${flags[@]}" -I. -Iinclude "$f" -o "$tmp/$name.new.cubin") || exit 2
  echo "== $f ($rev -> working tree)"
  python3 - "$tmp/$name.old.cubin" "$tmp/$name.new.cubin" <<'EOF' || status=1
import re, struct, sys

def kernels(path):
    d = open(path, 'rb').read()
    shoff, = struct.unpack_from('<Q', d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', d, 0x3A)
    hdr = [struct.unpack_from('<IIQQQQIIQQ', d, shoff + i * shentsize) for i in range(shnum)]
    names = hdr[shstrndx][4]
    text, info = {}, {}
    for h in hdr:
        n = d[names + h[0]:d.index(b'\0', names + h[0])].decode()
        for prefix, into in (('.text.', text), ('.nv.info.', info)):
            if n.startswith(prefix):
                key = re.sub(r'_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}', '_GLOBAL_', n[len(prefix):])
                into[key] = d[h[4]:h[4] + h[5]]
    return text, info

(old, old_info), (new, new_info) = kernels(sys.argv[1]), kernels(sys.argv[2])
added = [k for k in new if k not in old]
bad = 0
for k in sorted(set(old) | set(new)):
    if k not in new:
        # a kernel whose name changed (e.g. a template parameter added) and
        # whose code did not: the same bytes under one added name
        twin = [n for n in added if new[n] == old[k]]
        if twin:
            note = '' if old_info.get(k) == new_info.get(twin[0]) else '; .nv.info differs'
            print(f'SAME     {k} (now {twin[0]}{note})')
            added.remove(twin[0])
            continue
        state, bad = 'GONE', 1
    elif k not in old:
        if k not in added:
            continue
        state = 'NEW'
    elif old[k] == new[k]:
        state = 'SAME'
    else:
        state, bad = 'DIFFERS', 1
    note = '' if k not in old or k not in new or old_info.get(k) == new_info.get(k) else ' (.nv.info differs)'
    print(f'{state:8s} {k}{note}')
sys.exit(bad)
EOF
done
exit "$status"
