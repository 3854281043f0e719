#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Prints which source files call into which, from built object files, and
# the call circles: sets of two or more files that reach each other.
#
#   tools/call_graph.sh [OBJDIR]     default: build/connector/CMakeFiles/kvc_objs.dir
#   tools/call_graph.sh --circles [OBJDIR]
#   tools/call_graph.sh --no-circles [OBJDIR]
#
# A file calls into another when its object leaves a symbol undefined that
# the other defines (nm).  Build first; any CMake object directory works,
# e.g. build/proxy/CMakeFiles/pxcore.dir.  A circle of two (x.c and y.c
# calling each other) is a close pair; a wider one means the files do not
# stack in layers.  Exits 1 when a circle has more than two files; with
# --no-circles, when there is any circle at all.
set -eu

cd "$(dirname "$0")/.."
only_circles=0
max_size=2
if [ "${1:-}" = "--circles" ]; then
    only_circles=1
    shift
elif [ "${1:-}" = "--no-circles" ]; then
    only_circles=1
    max_size=1
    shift
fi
dir=${1:-build/connector/CMakeFiles/kvc_objs.dir}
objs=$(find "$dir" -name '*.o' | sort)
if [ -z "$objs" ]; then
    echo "no object files under $dir: build first" >&2
    exit 2
fi

tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for o in $objs; do
    f=$(basename "$o" .o)
    nm "$o" | awk -v f="$f" '
        NF == 3 && $2 ~ /^[TDBR]$/ { print "def", f, $3 }
        NF == 2 && $1 == "U" { print "use", f, $2 }'
done | awk '
$1 == "def" { owner[$3] = $2; next }
$1 == "use" { uses[++nu] = $2 SUBSEP $3 }
END {
    for (u = 1; u <= nu; u++) {
        split(uses[u], p, SUBSEP)
        if ((p[2] in owner) && owner[p[2]] != p[1]) print p[1], owner[p[2]]
    }
}' | sort -u > "$tmp"

if [ "$only_circles" = 0 ]; then
    awk '{ print $1 " -> " $2 }' "$tmp"
    echo
fi

circles=$(awk -f tools/cycles.awk "$tmp" | sed 's/^cycle:/circle:/')
n=$(echo "$circles" | grep -c '^circle:' || true)
wide=$(echo "$circles" | awk -v m="$max_size" 'NF > m + 1' | grep -c . || true)
[ "$max_size" = 2 ] && what="wider than two files" || what="of any size"
echo "# circles: $n ($what: $wide)"
[ "$n" = 0 ] || echo "$circles"
[ "$wide" = 0 ]
