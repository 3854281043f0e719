#!/bin/sh
# Prints which source files call into which, from built object files, and
# the call circles: sets of two or more files that reach each other.
#
#   tools/call_graph.sh [OBJDIR]     default: build/connector/CMakeFiles/kvc_objs.dir
#   tools/call_graph.sh --circles [OBJDIR]
#
# A file calls into another when its object leaves a symbol undefined that
# the other defines (nm).  Build first; any CMake object directory works,
# e.g. build/proxy/CMakeFiles/pxcore.dir.  A circle of two (x.c and y.c
# calling each other) is a close pair; a wider one means the files do not
# stack in layers.  Exits 1 when a circle has more than two files.
set -eu

cd "$(dirname "$0")/.."
only_circles=0
if [ "${1:-}" = "--circles" ]; then
    only_circles=1
    shift
fi
dir=${1:-build/connector/CMakeFiles/kvc_objs.dir}
objs=$(find "$dir" -name '*.o' | sort)
if [ -z "$objs" ]; then
    echo "no object files under $dir: build first" >&2
    exit 2
fi

for o in $objs; do
    f=$(basename "$o" .o)
    nm "$o" | awk -v f="$f" '
        NF == 3 && $2 ~ /^[TDBR]$/ { print "def", f, $3 }
        NF == 2 && $1 == "U" { print "use", f, $2 }'
done | awk -v only_circles="$only_circles" '
$1 == "def" { owner[$3] = $2; file[$2] = 1; next }
$1 == "use" { file[$2] = 1; uses[++nu] = $2 SUBSEP $3 }
function visit(v,    i, j, n, w, list, c, size, m) {
    idx[v] = low[v] = counter++
    stack[++sp] = v; onstack[v] = 1
    n = split(out[v], list, " ")
    for (i = 1; i <= n; i++) {
        w = list[i]
        if (!(w in idx)) { visit(w); if (low[w] < low[v]) low[v] = low[w] }
        else if (onstack[w] && idx[w] < low[v]) low[v] = idx[w]
    }
    if (low[v] == idx[v]) {
        size = 0
        do { w = stack[sp--]; onstack[w] = 0; m[++size] = w } while (w != v)
        if (size < 2) return
        for (i = 2; i <= size; i++)
            for (j = i; j > 1 && m[j - 1] > m[j]; j--) { w = m[j]; m[j] = m[j - 1]; m[j - 1] = w }
        c = ""
        for (i = 1; i <= size; i++) c = c " " m[i]
        circles[++ncircles] = c
        if (size > 2) wide++
    }
}
END {
    for (u = 1; u <= nu; u++) {
        split(uses[u], p, SUBSEP)
        a = p[1]; s = p[2]
        if (!(s in owner) || owner[s] == a) continue
        b = owner[s]
        if (!((a, b) in adj)) { adj[a, b] = 1; out[a] = out[a] " " b }
    }
    if (!only_circles) {
        for (a in file) {
            n = split(out[a], list, " ")
            for (i = 1; i <= n; i++) print a " -> " list[i] | "sort"
        }
        close("sort")
        print ""
    }
    counter = 0; sp = 0; ncircles = 0; wide = 0
    for (v in file) if (!(v in idx)) visit(v)
    print "# circles: " ncircles " (wider than two files: " wide ")"
    for (i = 1; i <= ncircles; i++) print "circle:" circles[i] | "sort"
    close("sort")
    exit (wide > 0)
}'
