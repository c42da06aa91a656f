#!/bin/sh
# decode-table.sh MLART_DECODE ARGS...: run mlart-decode with ARGS and check
# that its summary table stays aligned: the value line has as many columns as
# the header, the first three (names) start where their headers start and
# every other (a number) ends where its header ends.  Exits 1, printing both
# lines and the first column out of place, when they are not; the run itself
# must succeed.
set -u
dec=$1
shift
out=$("$dec" "$@") || { echo "mlart-decode $* failed (exit $?)"; exit 1; }
printf '%s\n' "$out" | awk '
# the start and end (1-based) of each run of non-blanks of s, into st[] and en[]; returns the count
function cols(s, st, en,    i, n, inside) {
    n = 0
    inside = 0
    for (i = 1; i <= length(s); i++) {
        if (substr(s, i, 1) != " " && !inside) {
            st[++n] = i
            inside = 1
        } else if (substr(s, i, 1) == " " && inside) {
            en[n] = i - 1
            inside = 0
        }
    }
    if (inside)
        en[n] = length(s)
    return n
}
/^backend / && !head { head = $0; getline row; found = 1 }
END {
    if (!found) { print "no table in the output"; exit 1 }
    print head
    print row
    nh = cols(head, hs, he)
    nr = cols(row, rs, re)
    if (nh != nr) { printf "%d header columns, %d values\n", nh, nr; exit 1 }
    for (c = 1; c <= nh; c++) {
        if (c <= 3 ? hs[c] != rs[c] : he[c] != re[c]) {
            printf "column %d out of place: header at %d..%d, value at %d..%d\n", c, hs[c], he[c], rs[c], re[c]
            exit 1
        }
    }
    printf "%d columns aligned\n", nh
}'
