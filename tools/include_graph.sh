#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Prints the include graph of the C sources and any include cycles.
#
#   tools/include_graph.sh            files, modules and cycles
#   tools/include_graph.sh --cycles   only the cycles
#   tools/include_graph.sh --layers   only the quoted includes that do not
#                                     name their layer
#
# Exits 1 when there is a cycle (--layers: such an include).
#
# Only `#include "..."` counts.  The include root is the top of the
# project, the only include directory of the build: a quoted include names
# the file's layer and path from there ("base/conn.h", "proxy/route.h",
# "connector/kvc_int.h", "include/kvconnector.h", "sim/engine.h",
# "tests/cudasim/cudasim.h").  System headers and stand-ins for them
# (tests/cudasim's cuda_runtime_api.h) are included with <...>.  Files are
# those git tracks (every .c and .h below the top when run outside a
# checkout).
#
# A module is a .c file with its .h (proxy/route.c + proxy/route.h).  Module
# x uses module y when x.c or x.h includes y.h.  A cycle is a set of two or
# more modules that reach each other through these edges, e.g. x.c includes
# y.h while y.c includes x.h: the files no longer stack in layers.
# A private header x_int.h counts as part of module x when x.c exists.
set -eu

cd "$(dirname "$0")/.."
only_cycles=0
only_layers=0
[ "${1:-}" = "--cycles" ] && only_cycles=1
[ "${1:-}" = "--layers" ] && only_layers=1

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    files=$(git ls-files '*.c' '*.h')
else
    files=$(find . -name '*.c' -o -name '*.h' | sed 's|^\./||' | sort)
fi

# "includer included" pairs; an include that names no file from the top
# of the project, or no layer directory, is "includer !name".
pairs=$(for f in $files; do
    grep -h '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" |
        sed 's/^[^"]*"\([^"]*\)".*/\1/' |
        while read -r name; do
            case "$name" in
            base/* | connector/* | include/* | proxy/* | sim/* | tests/* | bench/* | tools/*)
                if [ -f "$name" ]; then
                    printf '%s %s\n' "$f" "$name"
                    continue
                fi ;;
            esac
            printf '%s !%s\n' "$f" "$name"
        done
done | sort -u)
unlayered=$(echo "$pairs" | awk '$2 ~ /^!/ { print $1 ": #include \"" substr($2, 2) "\"" }')
if [ "$only_layers" = 1 ]; then
    n=$(echo "$unlayered" | grep -c . || true)
    echo "# includes without their layer: $n"
    [ "$n" = 0 ] || echo "$unlayered"
    [ "$n" = 0 ]
    exit
fi
edges=$(echo "$pairs" | awk '$2 !~ /^!/')

if [ "$only_cycles" = 0 ]; then
    echo "# files: includer -> included"
    echo "$edges" | awk 'NF == 2 { print $1 " -> " $2 }'
    echo
    echo "# modules: x -> y when x.c or x.h includes y.h"
fi

# The same folded to modules.
modules=$(echo "$edges" | awk '
function base(p) { sub(/\.[ch]$/, "", p); return p }
# x_int.h, private to x.c and its neighbours, belongs to module x.
function module(p,    m) {
    m = base(p)
    if (m ~ /_int$/ && (substr(m, 1, length(m) - 4) in hasc)) m = substr(m, 1, length(m) - 4)
    return m
}
NF == 2 {
    from[++ne] = $1; to[ne] = $2
    if ($1 ~ /\.c$/) hasc[base($1)] = 1
}
END {
    for (e = 1; e <= ne; e++) {
        a = module(from[e]); b = module(to[e])
        if (a != b) print a, b
    }
}' | sort -u)

if [ "$only_cycles" = 0 ]; then
    echo "$modules" | awk 'NF == 2 { print $1 " -> " $2 }'
    echo
fi

cycles=$(echo "$modules" | awk -f tools/cycles.awk)
n=$(echo "$cycles" | grep -c '^cycle:' || true)
echo "# cycles: $n"
[ "$n" = 0 ] || echo "$cycles"
[ "$n" = 0 ]
