# SPDX-License-Identifier: Apache-2.0
"""The docs are true: docs/flags.md's table is generated from pdproxy's
config table (regenerate with `pdproxy --help-markdown`) and kept in step,
--help is grouped and fits 80 columns, --version says what was built, no
file cites a document outside the tree, and the documented commands run:
README's engine-sim quick start (on free ports) with its chat request, and
docs/configuration.md's pool example, configuration file example and the
error it documents.  (docs.site builds the site: links and nav.)"""
import json
import os
import re
import shlex
import subprocess
import tempfile
import unittest

from pdharness.client import http_request
from pdharness.net import free_port, wait_until
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

    def test_flags_table_matches_the_binary(self):
        out = subprocess.run([PDPROXY, "--help-markdown"], capture_output=True, text=True,
                             timeout=10)
        self.assertEqual(out.returncode, 0, out.stderr)
        with open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8") as f:
            readme = f.read()
        begin = readme.index("<!-- flags:begin")
        begin = readme.index("\n", begin) + 1
        end = readme.index("<!-- flags:end -->")
        self.assertEqual(readme[begin:end], out.stdout,
                         "docs/flags.md's table is stale: paste `pdproxy --help-markdown`")

    def test_every_flag_in_help_is_documented(self):
        out = subprocess.run([PDPROXY, "--help"], capture_output=True, text=True, timeout=10)
        with open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8") as f:
            readme = f.read()
        for line in out.stdout.splitlines():
            if not line.startswith("  --"):
                continue    # a flag opens its line with two spaces
            line = line.strip()
            if not line.startswith(("--help", "--version")):
                flag = line.split()[0].split("/")[0]
                self.assertIn("`%s`" % flag, readme, flag)

    # --- --help, --version, the table's facts -------------------------------

    def help(self):
        out = subprocess.run([PDPROXY, "--help"], capture_output=True, text=True, timeout=10)
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout

    def test_help_is_grouped_and_fits_80_columns(self):
        text = self.help()
        wide = [l for l in text.splitlines() if len(l) > 80]
        self.assertEqual(wide, [], "--help lines over 80 columns")
        headings = [l[:-1] for l in text.splitlines() if l and not l.startswith(" ")
                    and l.endswith(":")]
        for g in ("Backends", "Routing", "Health and failover", "Security", "Metrics and logs",
                  "Operations"):
            self.assertIn(g, headings)
        self.assertNotIn("Other", headings, "a flag whose row in config_opts.c names no group")

    def test_metavars_name_what_the_value_is(self):
        text = self.help()
        self.assertRegex(text, r"\n  --prefix-load-factor FACTOR\b")
        self.assertRegex(text, r"\n  --disagg-bytes-per-token BYTES\b")
        # SECONDS only where the description speaks of seconds.
        lines = text.splitlines()
        for i, l in enumerate(lines):
            m = re.match(r"^  (--[a-z-]+) SECONDS", l)
            if m:
                desc = " ".join([l] + [x for x in lines[i + 1:i + 3] if x.startswith("    ")])
                self.assertIn("second", desc, m.group(1))

    def test_version_and_V_say_commit_and_build_options(self):
        outs = []
        for flag in ("--version", "-V"):
            p = subprocess.run([PDPROXY, flag], capture_output=True, text=True, timeout=10)
            self.assertEqual(p.returncode, 0, p.stderr)
            outs.append(p.stdout)
        self.assertEqual(outs[0], outs[1])
        v = outs[0]
        self.assertRegex(v.splitlines()[0], r"^pdproxy \d+\.\d+\.\d+$")
        for key in ("commit:", "build:", "TLS:", "libevent:", "CUDA", "UCX"):
            self.assertIn(key, v)
        self.assertRegex(v, r"commit: ([0-9a-f]{12}|unknown)\n")
        self.assertRegex(v, r"CUDA (on|off)")
        self.assertRegex(v, r"UCX \d+\.\d+")
        self.assertTrue(all(len(l) <= 80 for l in v.splitlines()), v)

    def test_pool_is_not_an_environment_variable(self):
        env = dict(os.environ, PDPROXY_POOL="llama")
        p = subprocess.run([PDPROXY, "--print-config"], capture_output=True, text=True,
                           timeout=10, env=env)
        self.assertEqual(p.returncode, 2, p.stdout)
        for page in ("README.md", "docs/flags.md", "docs/configuration.md"):
            with open(os.path.join(ROOT, page), encoding="utf-8") as f:
                self.assertNotIn("`PDPROXY_POOL`", f.read(), page)

    def test_one_kustomize_minimum(self):
        found = set()
        for d, _, files in os.walk(os.path.join(ROOT, "deploy")):
            if "node_modules" in d:
                continue
            for name in files:
                if name.endswith((".md", ".yaml", ".sh")):
                    with open(os.path.join(d, name), encoding="utf-8") as f:
                        found |= set(re.findall(r"kustomize v?(\d+\.\d+) or later", f.read()))
        self.assertEqual(found, {"4.1"}, "kustomize minimums stated in deploy/")

    # --- README's commands, run ----------------------------------------------

    def readme(self, page="README.md"):
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            return f.read()

    def block_after(self, heading, lang="sh", nth=0, page="README.md"):
        text = self.readme(page)
        at = text.index(heading)
        blocks = re.findall(r"```%s\n(.*?)```" % lang, text[at:], re.S)
        return blocks[nth]

    @staticmethod
    def commands(block):
        return [shlex.split(c) for c in block.replace("\\\n", " ").splitlines()
                if c.strip() and not c.lstrip().startswith("#")]

    def test_readme_quick_start_runs(self):
        """README's three commands (ports made free: the test runs beside
        others), then its chat request, as a newcomer follows them."""
        bindir = os.environ.get("PX_BIN_DIR") or os.path.dirname(PDPROXY)
        heading = "## Try it with two engine-sims"
        cmds = self.commands(self.block_after(heading, nth=1))
        self.assertEqual(len(cmds), 3, cmds)
        P, D, X = free_port(), free_port(), free_port()
        procs = []
        for c in cmds:
            self.assertEqual(c[-1], "&")
            c = [a for a in c if a != "&"]
            c[0] = os.path.join(bindir, os.path.basename(c[0]))
            c = [{"8100": str(P), "8200": str(D), "8192": str(X)}.get(a, a) for a in c]
            if c[0].endswith("pdproxy"):
                # The README relies on the toy default ports 8100/8200.
                c += ["--prefiller-ports", str(P), "--decoder-ports", str(D), "--port", str(X),
                      "--drain-delay", "0", "--threads", "1"]
            else:
                c += ["--num-blocks", "256", "--layers", "2", "--block-bytes", "4096"]
            procs.append(subprocess.Popen(c, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE,
                                          env=dict(os.environ, UCX_TLS="tcp,self",
                                                   UCX_WARN_UNUSED_ENV_VARS="n")))
        try:
            def ready(port, path):
                try:
                    return http_request(port, "GET", path, timeout=1).status == 200
                except OSError:
                    return False
            for port, path in ((P, "/health"), (D, "/health"), (X, "/ready")):
                self.assertTrue(wait_until(lambda: ready(port, path), 15, 0.05),
                                "README's quick start: :%d%s never answered 200" % (port, path))
            curl = shlex.split(self.block_after(heading, nth=2).replace("\\\n", " "))
            self.assertEqual(curl[0], "curl")
            url = curl[curl.index("-N") + 1].replace("8192", str(X))
            body = json.loads(curl[curl.index("-d") + 1])
            body["model"] = "sim-model"  # engine-sim's model
            body["max_tokens"] = 8
            r = http_request(X, "POST", url.split(str(X), 1)[1], json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"}, timeout=20)
            self.assertEqual(r.status, 200, r.body)
            self.assertIn(b"data: [DONE]", r.body)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def test_readme_pool_and_config_examples_parse(self):
        conf = "docs/configuration.md"
        pool = self.commands(self.block_after("## Model pools", page=conf))[0]
        self.assertEqual(pool[0], "pdproxy")
        p = subprocess.run([PDPROXY] + pool[1:] + ["--print-config"], capture_output=True,
                           text=True, timeout=10)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("qwen", p.stdout)
        yml = self.block_after("## Configuration file and reloads", lang="yaml", page=conf)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "pdproxy.yaml")
            with open(path, "w", encoding="utf-8") as f:
                f.write(yml)
            p = subprocess.run([PDPROXY, "--config", path, "--print-config"],
                               capture_output=True, text=True, timeout=10)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("least_inflight", p.stdout)
            # The error README quotes, with its file, line and key.
            m = re.search(r"`pdproxy: (\S+):(\d+): (key 'max-inflight': 'lots': [^`]*)`",
                          self.readme(conf))
            self.assertIsNotNone(m, "the config error example of " + conf)
            line = int(m.group(2))
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(["# comment"] * (line - 1) + ["max-inflight: lots", ""]))
            p = subprocess.run([PDPROXY, "--config", path, "--print-config"],
                               capture_output=True, text=True, timeout=10)
            self.assertEqual(p.returncode, 2)
            self.assertIn("pdproxy: %s:%d: %s" % (path, line, m.group(3)), p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
