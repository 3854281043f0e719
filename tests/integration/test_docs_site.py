#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The documentation site builds: `mkdocs build --strict` (Debian's mkdocs)
fails on a link to a page or file that does not exist, and every page under
docs/ must be in mkdocs.yml's nav (mkdocs itself only notes a page left out).
Exits 1 with what is wrong."""
import os
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.environ.get("PX_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")


def nav_pages(nav):
    for item in nav:
        if isinstance(item, dict):
            for v in item.values():
                if isinstance(v, list):
                    yield from nav_pages(v)
                else:
                    yield v
        else:
            yield item


def main():
    mk = shutil.which("mkdocs")
    if not mk:
        print("docs.site: FAIL: mkdocs not found (deploy/local/install-deps.sh installs "
              "Debian's mkdocs)", file=sys.stderr)
        return 1
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        conf = yaml.safe_load(f)
    docs = os.path.join(ROOT, conf.get("docs_dir", "docs"))
    pages = {os.path.relpath(os.path.join(d, n), docs)
             for d, _, files in os.walk(docs) for n in files if n.endswith(".md")}
    in_nav = set(nav_pages(conf.get("nav") or []))
    errors = ["docs/%s is not in mkdocs.yml's nav" % p for p in sorted(pages - in_nav)]
    errors += ["mkdocs.yml's nav names %s, which docs/ lacks" % p for p in sorted(in_nav - pages)]
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([mk, "build", "--strict", "--config-file",
                            os.path.join(ROOT, "mkdocs.yml"), "--site-dir", out],
                           capture_output=True, text=True, timeout=120)
        if r.returncode:
            errors += ["mkdocs build --strict: " + l for l in (r.stdout + r.stderr).splitlines()
                       if "WARNING" in l or "ERROR" in l or "Abort" in l] or ["mkdocs failed"]
        else:
            built = sum(1 for d, _, fs in os.walk(out) for n in fs if n == "index.html")
            print("docs.site: %d pages in the nav, %d HTML pages built" % (len(in_nav), built))
    for e in errors:
        print("docs.site: FAIL: " + e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
