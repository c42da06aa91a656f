#!/bin/sh
# Install the build into a temporary prefix, then build the example of
# README.md out of tree with find_package(mlart) and with pkg-config,
# shared and static, and a program of the rendezvous archive against both
# libraries, and run each binary.
# usage: install_consumer.sh BUILD_DIR SOURCE_DIR C_COMPILER CMAKE
set -eu
build=$1 src=$2 cc=$3 cmake=$4
command -v pkg-config >/dev/null 2>&1 || { echo "pkg-config not found: skipped"; exit 77; }
work=$(mktemp -d "${TMPDIR:-/tmp}/mlart-install-XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log" 2>&1 ||
    { cat "$work/install.log"; echo "FAIL: cmake --install"; exit 1; }

# The example exactly as the documentation shows it: the first ```c block
# after the marker comment.
awk '/<!-- embedding-example -->/ { m = 1; next }
     m == 1 && /^```c$/ { m = 2; next }
     m == 2 && /^```$/ { exit }
     m == 2 { print }' "$src/README.md" >"$work/example.c"
[ -s "$work/example.c" ] || { echo "FAIL: no example found in README.md"; exit 1; }
echo "example: $(wc -l <"$work/example.c") lines from README.md"

pc=$(find "$prefix" -name mlart.pc | head -n 1)
cfg=$(find "$prefix" -name mlartConfig.cmake | head -n 1)
[ -n "$pc" ] || { echo "FAIL: mlart.pc not installed"; exit 1; }
[ -n "$cfg" ] || { echo "FAIL: mlartConfig.cmake not installed"; exit 1; }
libdir=$(dirname "$(dirname "$pc")")
for f in "$prefix/include/mlart/mlart.h" "$libdir/libmlart.a" "$libdir/libmlart.so"; do
    [ -e "$f" ] || { echo "FAIL: $f not installed"; exit 1; }
done

check_run() { # name, command...
    name=$1
    shift
    out=$("$@" 2>&1) || { echo "$out"; echo "FAIL: $name exited $?"; exit 1; }
    echo "$name: $out"
}

# 1. CMake package
mkdir "$work/cm"
cp "$src/tests/embed/consumer/CMakeLists.txt" "$work/example.c" "$work/cm/"
"$cmake" -S "$work/cm" -B "$work/cm/build" -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_C_COMPILER="$cc" >"$work/cm.log" 2>&1 &&
    "$cmake" --build "$work/cm/build" >>"$work/cm.log" 2>&1 ||
    { cat "$work/cm.log"; echo "FAIL: find_package(mlart) consumer"; exit 1; }
check_run "find_package mlart::mlart" "$work/cm/build/example_shared"
check_run "find_package mlart::mlart_static (whole archive)" "$work/cm/build/example_static"

# 2. pkg-config
export PKG_CONFIG_PATH="$(dirname "$pc")"
ver=$(pkg-config --modversion mlart)
flags=$(pkg-config --cflags --libs mlart)
"$cc" -std=c11 -o "$work/ex_pc" "$work/example.c" $flags ||
    { echo "FAIL: cc example.c $flags"; exit 1; }
check_run "pkg-config $ver shared ($flags)" env LD_LIBRARY_PATH="$libdir" "$work/ex_pc"
static=$(pkg-config --static --libs mlart | sed "s|-lmlart|-Wl,--whole-archive $libdir/libmlart.a -Wl,--no-whole-archive|")
"$cc" -std=c11 -o "$work/ex_pc_static" "$work/example.c" $(pkg-config --cflags mlart) $static ||
    { echo "FAIL: static link with Libs.private: $static"; exit 1; }
check_run "pkg-config --static (whole archive + Libs.private)" "$work/ex_pc_static"
# 3. the rendezvous archive beside either library: its errors reach
# mlart_last_error() of the library the program links
[ -e "$libdir/libmlart_rendezvous.a" ] || { echo "FAIL: libmlart_rendezvous.a not installed"; exit 1; }
cat >"$work/rdv.c" <<'EOF_C'
#include <mlart/rendezvous.h>
#include <stdio.h>
#include <string.h>
int main(void)
{
    char blob[8] = {0};
    if (mlart_rendezvous("127.0.0.1", 29999, 0, 1, blob, sizeof blob, 100) != 0)
        return 1; /* a group of one: nothing to exchange */
    if (mlart_rendezvous("127.0.0.1", 0, 0, 2, blob, sizeof blob, 100) != MLART_EINVAL ||
        !strstr(mlart_last_error(), "mlart_rendezvous"))
        return 2;
    printf("rendezvous: %s\n", mlart_last_error());
    return 0;
}
EOF_C
uv=$(pkg-config --static --libs mlart | tr ' ' '\n' | grep -E 'libuv|^-luv' | head -n 1)
"$cc" -std=c11 -o "$work/rdv_shared" "$work/rdv.c" $(pkg-config --cflags mlart) \
    "$libdir/libmlart_rendezvous.a" -L"$libdir" -lmlart $uv -pthread ||
    { echo "FAIL: libmlart_rendezvous.a with the shared library"; exit 1; }
check_run "libmlart_rendezvous.a + shared" env LD_LIBRARY_PATH="$libdir" "$work/rdv_shared"
"$cc" -std=c11 -o "$work/rdv_static" "$work/rdv.c" $(pkg-config --cflags mlart) \
    "$libdir/libmlart_rendezvous.a" "$libdir/libmlart.a" \
    $(pkg-config --static --libs mlart | sed 's/-lmlart//') ||
    { echo "FAIL: libmlart_rendezvous.a with the static library"; exit 1; }
check_run "libmlart_rendezvous.a + static" "$work/rdv_static"
echo "install + 4 consumers (cmake shared/static, pkg-config shared/static) and the rendezvous archive both ways built and ran"
