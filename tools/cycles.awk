# SPDX-License-Identifier: Apache-2.0
# Reads a directed graph, one edge "from to" a line, and prints each cycle
# (strongly connected component of two or more nodes, Tarjan's algorithm) as
# "cycle: a b c", members in name order, cycles sorted.  Used by
# include_graph.sh and call_graph.sh.
NF >= 2 && $1 != $2 {
    node[$1] = 1; node[$2] = 1
    if (!(($1, $2) in adj)) { adj[$1, $2] = 1; out[$1] = out[$1] " " $2 }
}
NF == 1 { node[$1] = 1 }
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
        c = "cycle:"
        for (i = 1; i <= size; i++) c = c " " m[i]
        print c | "sort"
    }
}
END {
    counter = 0; sp = 0
    for (v in node) if (!(v in idx)) visit(v)
    close("sort")
}
