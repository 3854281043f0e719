# SPDX-License-Identifier: Apache-2.0
"""README.md's flags table is generated from pdproxy's config table: this
keeps the two in step (regenerate with `pdproxy --help-markdown`)."""
import os
import subprocess
import unittest

from pdharness.procs import PDPROXY

ROOT = os.environ.get("PX_SOURCE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..")


class DocsTest(unittest.TestCase):
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
