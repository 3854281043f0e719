#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Proves that an image's runtime stage installs every shared library its
binaries load, without a Docker engine (deploy/check.sh runs it for both
images): each library that `ldd` lists is mapped to the Debian package that
owns it (dpkg's own file lists), and that package must be in the closure of
RUNTIME_PACKAGES' dependencies or of the base image's required packages.

    runtime-libs.py "PKG PKG ..." LDD_OUTPUT...

Each LDD_OUTPUT is a file holding `ldd BINARY`'s output, named ldd.BINARY.
Exits 1 after printing every library not covered."""
import os
import re
import subprocess
import sys


def main():
    runtime = sys.argv[1].split()
    ldd_files = sys.argv[2:]
    status = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package}\t${Essential}\t${Priority}\t${Provides}\t"
         "${Pre-Depends}, ${Depends}\n"], check=True, capture_output=True, text=True).stdout
    pkgs, provides = {}, {}
    for line in status.splitlines():
        f = line.split("\t")
        if len(f) < 5:
            continue
        name, essential, prio, prov, deps = f
        alts = []
        for d in deps.split(","):
            d = d.strip()
            if d:
                alts.append([re.split(r"[\s(:]", a.strip())[0] for a in d.split("|")])
        pkgs[name] = (essential == "yes" or prio == "required", alts)
        for p in prov.split(","):
            p = re.split(r"[\s(]", p.strip())[0]
            if p:
                provides.setdefault(p, []).append(name)

    def closure(roots):
        seen, todo = set(), list(roots)
        while todo:
            p = todo.pop()
            for real in ([p] if p in pkgs else provides.get(p, [])):
                if real in seen:
                    continue
                seen.add(real)
                for alt in pkgs[real][1]:
                    todo.extend(a for a in alt if a in pkgs or a in provides)
        return seen

    base = closure([p for p, (req, _) in pkgs.items() if req])  # what a slim base has
    image = closure(runtime) | base
    missing_rt = [p for p in runtime if p not in pkgs and p not in provides]
    libs = {}
    for path in ldd_files:
        b = os.path.basename(path)
        b = b[4:] if b.startswith("ldd.") else b
        for line in open(path):
            m = re.search(r"=>\s*(/\S+)", line) or re.match(r"\s*(/\S+)\s+\(", line)
            if m:
                libs.setdefault(m.group(1), set()).add(b)
    errors = []
    # file -> package from dpkg's own lists (one dpkg -S per library is slow)
    files = {}
    info = "/var/lib/dpkg/info"
    for fn in os.listdir(info):
        if fn.endswith(".list"):
            pkg = fn[:-5].split(":")[0]
            for f in open(os.path.join(info, fn), errors="replace"):
                f = f.rstrip("\n")
                if ".so" in f:
                    files.setdefault(f, pkg)
    owner = {}
    for lib in sorted(libs):
        cands = [lib, os.path.realpath(lib)]
        for c in list(cands):
            cands.append(c[4:] if c.startswith("/usr/") else "/usr" + c)
        for c in cands:
            if c in files:
                owner[lib] = files[c]
                break
        if lib not in owner:
            errors.append("%s (needed by %s) belongs to no Debian package"
                          % (lib, "/".join(sorted(libs[lib]))))
        elif owner[lib] not in image:
            errors.append("%s (needed by %s) is in package %s, which the runtime stage does not "
                          "install (add it to RUNTIME_PACKAGES)"
                          % (lib, "/".join(sorted(libs[lib])), owner[lib]))
    for p in missing_rt:
        print("   note: runtime package %s is not installed here; its dependencies were not "
              "followed" % p)
    if errors:
        for e in errors:
            print("deploy/check: FAIL: " + e, file=sys.stderr)
        return 1
    direct = sorted({owner[lib] for lib in owner} - base)
    print("   %d shared libraries, from %d packages; outside the base image: %s"
          % (len(libs), len(set(owner.values())), " ".join(direct)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
