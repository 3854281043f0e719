# SPDX-License-Identifier: Apache-2.0
"""The licence holds: LICENSE is Apache-2.0 and every source file carries its
SPDX identifier (tools/spdx.sh --check over the tree), and the check itself
fails on a file without one, which --fix repairs without breaking #! lines."""
import os
import subprocess
import tempfile
import unittest

ROOT = os.path.abspath(os.environ.get("PX_SOURCE_DIR")
                       or os.path.join(os.path.dirname(__file__), "..", ".."))
SPDX = os.path.join(ROOT, "tools", "spdx.sh")
ID = "SPDX-License-Identifier: Apache-2.0"


def run(*args):
    return subprocess.run(["sh", SPDX] + list(args), capture_output=True, text=True, timeout=120)


class LicenseTest(unittest.TestCase):
    def test_license_file_is_apache_2(self):
        with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
            text = f.read()
        self.assertIn("Apache License", text)
        self.assertIn("Version 2.0, January 2004", text)
        self.assertIn("END OF TERMS AND CONDITIONS", text)

    def test_every_source_file_has_the_identifier(self):
        out = run("--check", ROOT)
        self.assertEqual(out.returncode, 0, out.stderr)
        listed = run("--list", ROOT).stdout.split()
        # The check covers every language of the tree, not a few files.
        for suffix in (".c", ".h", "CMakeLists.txt", ".cmake", ".py", ".sh", ".lua", ".mjs",
                       ".yaml", "Dockerfile"):
            self.assertTrue(any(p.endswith(suffix) for p in listed), suffix)

    def test_check_fails_on_a_file_without_it_and_fix_repairs(self):
        with tempfile.TemporaryDirectory() as d:
            files = {
                "a.c": "int x;\n",
                "b.h": "/* header */\n",
                "CMakeLists.txt": "project(x C)\n",
                "s.sh": "#!/bin/sh\necho hi\n",
                "p.py": "#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\nprint(1)\n",
                "k.yaml": "a: 1\n",
                "w.lua": "return 1\n",
                "v.mjs": "export {};\n",
                "noext": "#!/usr/bin/env bash\ntrue\n",
                "data.json": "{}\n",
                "notes.md": "# notes\n",
            }
            for name, body in files.items():
                with open(os.path.join(d, name), "w", encoding="utf-8") as f:
                    f.write(body)
            os.chmod(os.path.join(d, "s.sh"), 0o755)
            out = run("--check", d)
            self.assertEqual(out.returncode, 1)
            for name in files:
                if name.endswith((".json", ".md")):
                    self.assertNotIn(name, out.stderr)
                else:
                    self.assertIn(name, out.stderr)
            out = run("--fix", d)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(run("--check", d).returncode, 0)

            def read(name):
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    return f.read()
            self.assertEqual(read("a.c"), "/* %s */\nint x;\n" % ID)
            self.assertEqual(read("s.sh"), "#!/bin/sh\n# %s\necho hi\n" % ID)
            self.assertTrue(os.access(os.path.join(d, "s.sh"), os.X_OK))
            self.assertEqual(read("p.py").splitlines()[:3],
                             ["#!/usr/bin/env python3", "# -*- coding: utf-8 -*-", "# " + ID])
            self.assertEqual(read("w.lua").splitlines()[0], "-- " + ID)
            self.assertEqual(read("v.mjs").splitlines()[0], "// " + ID)
            self.assertEqual(read("data.json"), "{}\n")
            # Idempotent: a second --fix changes nothing.
            before = read("a.c")
            run("--fix", d)
            self.assertEqual(read("a.c"), before)


if __name__ == "__main__":
    unittest.main(verbosity=2)
