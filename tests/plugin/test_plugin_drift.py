#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The connector against vLLM's interface as recorded once in
connector/python/pdkv/upstream.py (the vLLM commit, every public member of
KVConnectorBase_V1 with its parameters, and for each whether pdkv implements
it or deliberately inherits the default):
  - the stand-ins define exactly the recorded members (so the driver runs the
    connector against that interface, not against a convenient subset);
  - every recorded member is classified, and PdkvConnector overrides exactly
    the ones classified as implemented, with the recorded parameters;
  - every name the connector imports from vllm is one the stand-ins define;
  - where a real vLLM is importable, its base class has no member the record
    lacks or changed (skipped elsewhere);
  - no file restates another vLLM commit by hand."""
import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import unittest

import harness

harness.need_torch()
PKG = os.path.join(harness.ROOT, "connector", "python")
sys.path.insert(0, PKG)
from pdkv import upstream  # noqa: E402  (before the stand-ins: a real vLLM, if any, first)

REAL_VLLM = None
try:
    import vllm  # noqa: F401
    REAL_VLLM = os.path.dirname(vllm.__file__)
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[m]
except ImportError:
    pass
sys.path.insert(0, os.path.join(harness.HERE, "standins"))
SOURCES = [os.path.join(PKG, "pdkv", f) for f in sorted(os.listdir(os.path.join(PKG, "pdkv")))
           if f.endswith(".py")]


class Drift(unittest.TestCase):
    def base(self):
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
        self.assertIn(os.path.join("tests", "plugin", "standins"), base.__file__)
        return base

    def test_standins_define_the_recorded_members(self):
        base = self.base()
        found = upstream.members_of(base.KVConnectorBase_V1)
        self.assertEqual(upstream.diff(found, upstream.MEMBERS), [])
        self.assertEqual(upstream.diff(upstream.members_of(base.SupportsHMA),
                                       upstream.HMA_MEMBERS), [])
        self.assertEqual(set(base.KVConnectorBase_V1.__abstractmethods__),
                         {n for n, m in upstream.MEMBERS.items() if m[2]})
        import dataclasses
        self.assertEqual([f.name for f in dataclasses.fields(base.KVConnectorTransferResults)],
                         upstream.TRANSFER_RESULTS_FIELDS)

    def test_every_member_classified_and_overrides_match(self):
        from pdkv.connector import PdkvConnector
        recorded = dict(upstream.MEMBERS, **upstream.HMA_MEMBERS)
        self.assertEqual(set(upstream.POLICY), set(recorded),
                         "members recorded but not classified, or classified but not recorded")
        ours = vars(PdkvConnector)
        for name, policy in upstream.POLICY.items():
            if policy == upstream.IMPLEMENTED:
                self.assertIn(name, ours, "%s: classified implemented, not defined" % name)
                self.assertEqual(upstream.describe(ours[name])[:2], recorded[name][:2], name)
            else:
                self.assertNotIn(name, ours, "%s: classified inherited (%s) but overridden" %
                                 (name, policy))
        self.assertEqual(PdkvConnector.__abstractmethods__, frozenset())
        from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
        self.assertTrue(supports_hma(PdkvConnector))

    def test_vllm_imports_are_standins(self):
        seen = []
        for src in SOURCES:
            with open(src) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and \
                        node.module.startswith("vllm"):
                    mod = importlib.import_module(node.module)
                    self.assertIn(os.path.join("tests", "plugin", "standins"), mod.__file__)
                    for a in node.names:
                        self.assertTrue(hasattr(mod, a.name), "%s.%s: not in the stand-ins" %
                                        (node.module, a.name))
                        seen.append("%s.%s" % (node.module, a.name))
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        self.assertFalse(a.name.startswith("vllm"), (src, a.name))
        self.assertTrue(seen)

    @unittest.skipUnless(REAL_VLLM, "no vLLM installed for this interpreter")
    def test_installed_vllm_matches_the_record(self):
        r = subprocess.run([sys.executable, "-m", "pdkv.upstream"], capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=PKG), timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout[-4000:] + r.stderr[-2000:])

    def test_request_standin_refuses_unknown_attributes(self):
        from vllm.v1.request import Request
        r = Request("x", [1, 2], 1)
        with self.assertRaises(AttributeError):
            r.not_in_vllm = 1

    def test_required_layout(self):
        import types
        from pdkv.connector import PdkvConnector
        cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(use_mla=False))
        self.assertEqual(PdkvConnector.get_required_kvcache_layout(cfg), "HND")
        cfg.model_config.use_mla = True
        self.assertIsNone(PdkvConnector.get_required_kvcache_layout(cfg))

    def test_no_other_commit_named(self):
        """A 40-digit hex string in the plugin's files, its tests or its docs
        is one of the commits recorded in pdkv/upstream.py."""
        known = {upstream.VLLM_COMMIT} | {c for c, _ in upstream.SOURCES.values()}
        # The proxy's and engine-sim's own pins live on one page of their
        # own; its commits are known here, named anywhere else they fail.
        docs = os.path.join(harness.ROOT, "docs")
        pins = os.path.join(docs, "vllm-upstream.md")
        with open(pins) as f:
            known |= set(re.findall(r"(?<![0-9a-f])[0-9a-f]{40}(?![0-9a-f])", f.read()))
        files = SOURCES + [os.path.join(harness.ROOT, "README.md")]
        files += [os.path.join(docs, f) for f in os.listdir(docs)
                  if f.endswith(".md") and f != "vllm-upstream.md"]
        for d, _, names in os.walk(harness.HERE):
            files += [os.path.join(d, n) for n in names if n.endswith((".py", ".cmake", ".md"))]
        mentions = 0
        for path in files:
            with open(path, errors="replace") as f:
                text = f.read()
            for m in re.finditer(r"(?<![0-9a-f])[0-9a-f]{40}(?![0-9a-f])", text):
                self.assertIn(m.group(0), known, "%s names vLLM commit %s" % (path, m.group(0)))
            mentions += (path != upstream.__file__ and "vllm" in text.lower() and
                         bool(re.search(r"\bcommit [0-9a-f]{7,39}\b", text)))
        self.assertEqual(mentions, 0, "a short commit id restated by hand")

    def test_docs_follow_the_code(self):
        """README's example gives prefill and decode their own side-channel
        ports and creates the secret; docs/vllm-plugin.md names the recorded
        commit and every setting pdkv/config.py reads."""
        with open(os.path.join(harness.ROOT, "README.md")) as f:
            readme = f.read()
        sec = readme[readme.index("## libkvconnector in vLLM"):]
        sec = sec[:sec.find("\n## ", 5)] if "\n## " in sec[5:] else sec
        ports = set(re.findall(r"PDKV_SIDE_CHANNEL_PORT=(\d+) vllm serve", sec))
        self.assertEqual(len(ports), 2, "prefill and decode need their own ports: %s" % ports)
        self.assertIn("PDKV_SECRET_FILE=", sec)
        self.assertRegex(sec, r"openssl rand|/dev/urandom")
        self.assertIn("docs/vllm-plugin.md", sec)
        with open(os.path.join(harness.ROOT, "docs", "vllm-plugin.md")) as f:
            doc = f.read()
        self.assertIn(upstream.VLLM_COMMIT, doc)
        from pdkv import config
        with open(config.__file__) as f:
            src = f.read()
        for env in (config.ENV_HOST, config.ENV_PORT, config.ENV_SECRET_FILE,
                    config.ENV_ALLOWED):
            self.assertIn("`%s`" % env, doc)
        for key in set(re.findall(r'extra(?:\.get)?\(\s*"([a-z_]+)"', src)) | \
                set(re.findall(r'opt\("([a-z_]+)"\)', src)):
            self.assertIn(key, doc, "setting %s is not documented" % key)


if __name__ == "__main__":
    unittest.main(verbosity=2)
