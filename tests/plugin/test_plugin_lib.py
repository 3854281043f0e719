#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""pdkv.lib, the ctypes binding: where the library comes from (and a clear
error when it is nowhere), caller tokens, publish/fetch byte-exact between
torch tensors, TP slices, cancel."""
import json
import os
import subprocess
import sys
import time
import unittest

import harness

harness.need_torch()
sys.path.insert(0, os.path.join(harness.ROOT, "connector", "python"))
os.environ.update({k: v for k, v in harness.lib_env().items() if k.startswith(("PDKV", "KVC"))})

import torch  # noqa: E402

import pdkv  # noqa: E402
from pdkv import lib as kvc  # noqa: E402


def wait_events(evs, n, timeout=10):
    deadline = time.monotonic() + timeout
    while len([e for e in evs if e.type in (kvc.EventType.FETCH_DONE, kvc.EventType.FETCH_FAILED)]) < n \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    return [e for e in evs if e.type in (kvc.EventType.FETCH_DONE, kvc.EventType.FETCH_FAILED)]


class Lib(unittest.TestCase):
    def agents(self, n, tp=1):
        out = []
        for i in range(n):
            a = pdkv.Agent("E%d" % i, tp_size=tp)
            self.addCleanup(a.close)
            out.append(a)
        return out

    def test_library_found_and_named(self):
        self.assertEqual(pdkv.library_path(), os.path.realpath(os.environ["PDKV_LIBRARY"]))

    def test_library_missing_is_explained(self):
        code = "import pdkv\ntry:\n    pdkv.load_library()\nexcept OSError as e:\n    print(e)\n"
        env = dict(os.environ, PDKV_LIBRARY="/nonexistent/libkvconnector.so",
                   PYTHONPATH=os.path.join(harness.ROOT, "connector", "python"))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=30).stdout
        self.assertIn("libkvconnector not found", out)
        self.assertIn("/nonexistent/libkvconnector.so ($PDKV_LIBRARY): no such file", out)
        self.assertIn("Set PDKV_LIBRARY", out)

    def test_pip_installs_offline(self):
        """pip install ./connector/python: no index, no compiled extension."""
        import shutil
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "src")
            shutil.copytree(os.path.join(harness.ROOT, "connector", "python"), src,
                            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
            r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                                "--no-build-isolation", "--target", os.path.join(tmp, "t"), src],
                               capture_output=True, text=True, timeout=120)
            if "No module named pip" in r.stderr:
                self.skipTest("pip is not installed for %s" % sys.executable)
            self.assertEqual(r.returncode, 0, r.stderr[-2000:])
            code = "import pdkv, sys; print(pdkv.library_path()); print(pdkv.__file__)"
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=os.path.join(tmp, "t")),
                                 cwd=tmp, timeout=60).stdout.split("\n")
            self.assertEqual(out[0], os.path.realpath(os.environ["PDKV_LIBRARY"]))
            self.assertTrue(out[1].startswith(os.path.join(tmp, "t")), out)

    def test_caller_token_and_bytes(self):
        p, d = self.agents(2)
        src = torch.randint(0, 255, (16, 256), dtype=torch.uint8)
        dst = torch.zeros(16, 256, dtype=torch.uint8)
        p.register_regions(16, [(src.data_ptr(), src.numel())])
        d.register_regions(16, [(dst.data_ptr(), dst.numel())])
        evs = []
        p.start(evs.append)
        d.start(evs.append)
        tok = kvc.new_token()
        self.assertRegex(tok, "^[0-9a-f]{32}$")
        kv = json.loads(p.publish("req", [3, 4, 5], token=tok))
        self.assertEqual(kv["remote_kv_token"], tok)
        d.fetch(kv, [10, 11, 12])
        got = wait_events(evs, 1)
        self.assertEqual([e.name for e in got], ["FETCH_DONE"], [e.message for e in got])
        self.assertTrue(torch.equal(dst[10:13], src[3:6]))
        self.assertEqual(int(dst[:10].sum()) + int(dst[13:].sum()), 0)

    def test_bad_token_refused_by_publish(self):
        p, = self.agents(1)
        src = torch.zeros(4, 64, dtype=torch.uint8)
        p.register_regions(4, [(src.data_ptr(), src.numel())])
        with self.assertRaises(kvc.KvcError) as cm:
            p.publish("x", [0], token="not-hex")
        self.assertIn("KVC_ERR_INVALID_PARAM", str(cm.exception))

    # Runs of several blocks, each block into one half of a local block.
    def test_slice_into_local_parts(self):
        """TP 2->1: two producers' blocks into the halves of local blocks."""
        nb, bl, n = 8, 64, 3
        p0, p1, d = self.agents(3)
        pt = [torch.randint(0, 255, (nb, bl), dtype=torch.uint8) for _ in range(2)]
        dt = torch.zeros(nb, 2 * bl, dtype=torch.uint8)
        for a, t in zip((p0, p1), pt):
            a.register_regions(nb, [(t.data_ptr(), t.numel())])
        d.register_regions(nb, [(dt.data_ptr(), dt.numel())])
        evs = []
        for a in (p0, p1, d):
            a.start(evs.append)
        tok = kvc.new_token()
        kvs = [json.loads(a.publish("r", list(range(2, 2 + n)), token=tok)) for a in (p0, p1)]
        for j, kv in enumerate(kvs):
            d.fetch(kv, list(range(1, 1 + n)), parts=(1, 0, 2, j))
        got = wait_events(evs, 2)
        self.assertEqual([e.name for e in got], ["FETCH_DONE"] * 2, [e.message for e in got])
        for i in range(n):
            for j in range(2):
                self.assertTrue(torch.equal(dt[1 + i, j * bl:(j + 1) * bl], pt[j][2 + i]))

    def test_cancel(self):
        p, d = self.agents(2)
        src = torch.zeros(4, 64, dtype=torch.uint8)
        dst = torch.zeros(4, 64, dtype=torch.uint8)
        p.register_regions(4, [(src.data_ptr(), src.numel())])
        d.register_regions(4, [(dst.data_ptr(), dst.numel())])
        evs = []
        d.start(evs.append)
        p.start(evs.append)
        kv = {"remote_engine_id": "E0", "remote_request_id": "later", "remote_host": "127.0.0.1",
              "remote_port": p.port, "remote_block_ids": [1], "remote_kv_token": kvc.new_token()}
        xid = d.fetch(kv, [2], wait_ms=10000)  # held by the producer: not published yet
        self.assertEqual(d.cancel(xid), kvc.Status.OK)
        got = wait_events(evs, 1)
        self.assertEqual([(e.name, kvc.status_str(e.status)) for e in got],
                         [("FETCH_FAILED", "KVC_ERR_CANCELED")])
        self.assertEqual(d.cancel(xid), kvc.Status.ERR_NOT_FOUND)


if __name__ == "__main__":
    unittest.main(verbosity=2)
