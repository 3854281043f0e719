#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Lists the product's C files (base/, connector/, proxy/, sim/, include/:
# every .c and .h) longer than a limit, longest first.
#
#   tools/file_size.sh [LIMIT]     default 1200 lines
#
# Exits 1 when any file passes the limit: a file that must grow past it is
# split first, by job, on purpose (README, "How the code is laid out").
# tools/file_size.budget gives some files a limit of their own (lower or
# higher), each with the reason: a feature that needs more room raises its
# line there, on purpose, in its own commit.
# Files are those git tracks or would (every .c and .h below those folders
# when run outside a checkout).
set -eu

cd "$(dirname "$0")/.."
limit=${1:-1200}
dirs="base connector proxy sim include"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    files=$(git ls-files --cached --others --exclude-standard -- $(for d in $dirs; do printf '%s/*.c %s/*.h ' "$d" "$d"; done))
else
    files=$(find $dirs -name '*.[ch]' | sort)
fi
budget=tools/file_size.budget
own() { # the limit of file $1: its line in the budget, else the default
    l=$( [ -f "$budget" ] && awk -v f="$1" '$1 == f { print $2 }' "$budget")
    echo "${l:-$limit}"
}
if [ -f "$budget" ]; then
    awk '!/^#/ && NF' "$budget" | while read -r f l _; do
        [ -f "$f" ] || { echo "$budget: $f does not exist" >&2; exit 1; }
    done
fi
over=$(for f in $files; do
    [ -f "$f" ] || continue
    n=$(wc -l < "$f")
    l=$(own "$f")
    [ "$n" -gt "$l" ] && echo "$n $l $f"
done | sort -rn)
if [ -n "$over" ]; then
    echo "$over" | while read -r n l f; do
        echo "$f: $n lines, over its $l: split it by job before it grows further" >&2
    done
    exit 1
fi
echo "no product C file over $limit lines, nor over its own limit in $budget"
