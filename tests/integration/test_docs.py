# SPDX-License-Identifier: Apache-2.0
"""README.md's flags table is generated from pdproxy's config table: this
keeps the two in step (regenerate with `pdproxy --help-markdown`)."""
import os
import subprocess
import unittest

from pdharness.procs import PDPROXY

ROOT = os.environ.get("PX_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")


def tracked_files():
    """The repository's text files (git's list when this is a checkout)."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            return [os.path.join(ROOT, p) for p in out.stdout.split()]
    except OSError:
        pass
    paths = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if not x.startswith(("build", ".git", "node_modules"))]
        paths += [os.path.join(d, f) for f in files]
    return paths


class DocsTest(unittest.TestCase):
    def test_no_file_relies_on_documents_outside_the_tree(self):
        """The design the code cites is docs/ARCHITECTURE.md, in the tree."""
        self.assertTrue(os.path.isfile(os.path.join(ROOT, "docs", "ARCHITECTURE.md")))
        bad = []
        for p in tracked_files():
            if "/tests/fuzz/corpus/" in p or not os.path.isfile(p):
                continue
            try:
                with open(p, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            if p.endswith("test_docs.py"):
                continue
            for needle in ("DESIGN.md", "../shared"):
                if needle in text:
                    bad.append("%s: %s" % (os.path.relpath(p, ROOT), needle))
        self.assertEqual(bad, [], "files citing documents that a clone does not have")
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            self.assertIn("docs/ARCHITECTURE.md", f.read())

    def test_readme_flags_table_matches_the_binary(self):
        out = subprocess.run([PDPROXY, "--help-markdown"], capture_output=True, text=True,
                             timeout=10)
        self.assertEqual(out.returncode, 0, out.stderr)
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        begin = readme.index("<!-- flags:begin")
        begin = readme.index("\n", begin) + 1
        end = readme.index("<!-- flags:end -->")
        self.assertEqual(readme[begin:end], out.stdout,
                         "README.md's flags table is stale: paste `pdproxy --help-markdown`")

    def test_every_flag_in_help_is_documented(self):
        out = subprocess.run([PDPROXY, "--help"], capture_output=True, text=True, timeout=10)
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        for line in out.stdout.splitlines():
            line = line.strip()
            if line.startswith("--") and not line.startswith(("--help", "--version")):
                flag = line.split()[0].split("/")[0]
                self.assertIn("`%s`" % flag, readme, flag)


if __name__ == "__main__":
    unittest.main(verbosity=2)
