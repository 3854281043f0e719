#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
#
# Every source file of the project carries an SPDX licence identifier near its
# top (the LICENSE file is Apache-2.0).  This script finds those that lack it
# and, with --fix, adds it in the comment syntax of the file's language.
#
#   tools/spdx.sh --check [PATH...]   list files without the identifier; exit 1 if any
#   tools/spdx.sh --fix [PATH...]     add the identifier where it is missing
#   tools/spdx.sh --list [PATH...]    the files the check covers
#
# PATHs are files or directories (default: the repository root).  In a git
# checkout the files are those git tracks or would track (untracked files that
# .gitignore does not exclude), so a branch's new files are covered before they
# are committed; elsewhere (a source tarball) every file under the PATHs but
# build*/ directories.
#
# Covered: C (.c .h), CMake (CMakeLists.txt, .cmake), Python, shell (.sh, and
# any file starting with a #! line naming sh or bash), Lua, JavaScript (.js
# .mjs), YAML (.yaml .yml, .clang-format), awk, Dockerfiles.  Not covered:
# formats without comments (JSON), documentation (Markdown) and data (fuzz
# corpora and dictionaries, test fixtures under tests/fuzz/).
#
# The identifier must be within a file's first 5 lines.  --fix puts it on the
# first line, or after a #! line (and after a Python coding declaration).
set -eu

ID='SPDX-License-Identifier: Apache-2.0'
mode=${1:-}
case "$mode" in
--check | --fix | --list) shift ;;
*)
    sed -n '4,10p' "$0" >&2
    exit 2
    ;;
esac

root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -gt 0 ] || set -- "$root"

# The comment a file's identifier line takes, by name and first line; empty:
# not a source file.
style() {
    f=$1
    case "$f" in
    */tests/fuzz/corpus/* | tests/fuzz/corpus/*) return 0 ;;
    esac
    case "${f##*/}" in
    *.c | *.h) echo c ;;
    CMakeLists.txt | *.cmake | *.py | *.sh | *.yaml | *.yml | .clang-format | *.awk | \
        Dockerfile | Dockerfile.* | *.Dockerfile) echo hash ;;
    *.lua) echo lua ;;
    *.js | *.mjs) echo js ;;
    *.*) ;;
    *)
        first=$(head -c 64 "$f" 2>/dev/null | head -n 1) || first=
        case "$first" in
        '#!'*sh*) echo hash ;;
        '#!'*python*) echo hash ;;
        esac
        ;;
    esac
}

files() {
    for p in "$@"; do
        if [ -d "$p" ]; then
            if git -C "$p" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
                # Paths relative to $p, printed with its prefix.
                git -C "$p" ls-files --cached --others --exclude-standard -- . |
                    while IFS= read -r f; do
                        [ -f "$p/$f" ] && printf '%s\n' "$p/$f"
                    done
            else
                find "$p" -name 'build*' -prune -o -name .git -prune -o -name node_modules -prune \
                    -o -type f -print
            fi
        elif [ -f "$p" ]; then
            printf '%s\n' "$p"
        else
            echo "spdx: $p: no such file or directory" >&2
            exit 2
        fi
    done | sort -u
}

fix() {
    f=$1 st=$2
    case "$st" in
    c) line="/* $ID */" ;;
    hash) line="# $ID" ;;
    lua) line="-- $ID" ;;
    js) line="// $ID" ;;
    esac
    # Line after which it goes: a #! line, then a Python coding declaration.
    after=0
    if head -n 1 "$f" | grep -q '^#!'; then after=1; fi
    if sed -n "$((after + 1))p" "$f" | grep -Eq '^#.*coding[:=]'; then after=$((after + 1)); fi
    tmp="$f.spdx.$$"
    {
        [ "$after" -gt 0 ] && head -n "$after" "$f"
        printf '%s\n' "$line"
        tail -n "+$((after + 1))" "$f"
    } >"$tmp"
    # Keep the mode (executable scripts stay executable).
    chmod "$(stat -c %a "$f")" "$tmp"
    mv "$tmp" "$f"
}

missing=0
list=$(files "$@")
old_ifs=$IFS
IFS='
'
for f in $list; do
    IFS=$old_ifs
    st=$(style "$f")
    [ -n "$st" ] || continue
    if [ "$mode" = --list ]; then
        printf '%s\n' "$f"
        continue
    fi
    head -n 5 "$f" | grep -q "$ID" && continue
    if [ "$mode" = --fix ]; then
        fix "$f" "$st"
        echo "spdx: added to ${f#"$root"/}"
    else
        echo "spdx: no '$ID' in the first 5 lines of ${f#"$root"/}" >&2
        missing=$((missing + 1))
    fi
done
IFS=$old_ifs
if [ "$missing" -gt 0 ]; then
    echo "spdx: $missing file(s) without the identifier: run tools/spdx.sh --fix" >&2
    exit 1
fi
exit 0
