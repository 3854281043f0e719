#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vLLM's KV layouts through PdkvConnector: FlashAttention per-layer
[2, num_blocks, block_size, heads, head] in HND (K and V planes: two regions
per layer, several layers), MLA [num_blocks, block_size, head]; heterogeneous
TP 1->2 and 2->1 through partial-block reads (each decode rank holds its
heads; prefill ranks on remote_port + rank); NHD with heterogeneous TP is
refused clearly (no head split without HND, as NIXL states).  Prefill and
decode engines run in this process (separate agents, UCX between them) to
keep the suite short; test_plugin_flow.py runs them as two processes."""
import logging
import queue
import threading
import time
import unittest

import harness

harness.need_torch()
import os  # noqa: E402
os.environ.update({k: v for k, v in harness.lib_env().items() if k.startswith(("PDKV", "KVC"))})
import driver  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402


class Local:
    """driver.Engine stepped by a thread; run() waits for one request."""

    def __init__(self, name, tp, geo, extra=None):
        self.e = driver.Engine(name, tp=tp, geo=geo, port=harness.free_ports(tp),
                               extra=dict({"fetch_wait_ms": 5000, "xfer_timeout_ms": 5000},
                                          **(extra or {})))
        self.q = {}
        self.e.on_token = lambda req, tok, params: self.q[req.request_id].put((tok, params,
                                                                              req.status))
        self.stop = False
        self.t = threading.Thread(target=self.loop, daemon=True)
        self.t.start()

    def loop(self):
        while not self.stop:
            self.e.step()
            time.sleep(0.001)  # the engine's step pace

    def run(self, rid, prompt, max_tokens, params):
        return self.run_req(Request(rid, prompt, max_tokens, params))

    def run_req(self, req):
        """Adds req; waits for its end: (tokens, kv_transfer_params, status)."""
        self.q[req.request_id] = q = queue.Queue()
        self.e.add(req)
        toks = []
        while True:
            tok, out, status = q.get(timeout=30)
            if tok is None:
                return toks, out, status
            toks.append(tok)

    def close(self):
        self.stop = True
        self.t.join(timeout=10)
        self.e.shutdown()


class Layouts(unittest.TestCase):
    def pair(self, ptp, dtp, **geo):
        g = dict(layers=3, num_blocks=64)
        g.update(geo)
        p = Local("P", ptp, driver.Geometry(**g))
        self.addCleanup(p.close)
        d = Local("D", dtp, driver.Geometry(**g))
        self.addCleanup(d.close)
        return p, d

    def flow(self, p, d, sizes=(10, 33, 70)):
        for i, n in enumerate(sizes):
            prompt = list(range(i * 3, i * 3 + n))
            ptok, kv, st = p.run("p%d" % i, prompt, 1, {"do_remote_decode": True})
            self.assertEqual(st, RequestStatus.FINISHED_LENGTH_CAPPED)
            dtok, _, st = d.run("d%d" % i, prompt, 3, dict(kv))
            self.assertEqual(st, RequestStatus.FINISHED_LENGTH_CAPPED, d.e.state())
        ds = d.e.state()
        self.assertEqual((ds["verified"], ds["corrupt"], ds["load_failed"]),
                         (len(sizes), 0, 0), (ds, d.e.corrupt))
        left = harness.wait_value(lambda: p.e.state()["published_now"], lambda n: n == 0, 10, 0.01)
        self.assertEqual(left, 0)
        bad, never = d.e.untouched()
        self.assertEqual(bad, [])
        self.assertGreater(never, 0)

    def test_tp1_to_tp2(self):
        self.flow(*self.pair(1, 2))

    # Runs of several blocks into local part j of 2 (test_plugin_lib.py's
    # test_slice_into_local_parts checks the library alone).
    def test_tp2_to_tp1(self):
        self.flow(*self.pair(2, 1))

    def test_tp2_to_tp1_one_block(self):
        self.flow(*self.pair(2, 1), sizes=(9, 12))

    def test_mla(self):
        self.flow(*self.pair(1, 1, mla=True, head_size=24))

    def test_mla_tp2_to_tp1(self):
        # MLA is replicated: decode reads one prefill rank, notifies both
        self.flow(*self.pair(2, 1, mla=True, head_size=24))

    def test_nhd_heterogeneous_refused(self):
        p, d = self.pair(1, 2, hnd=False)
        prompt = list(range(20))
        _, kv, _ = p.run("n", prompt, 1, {"do_remote_decode": True})
        with self.assertLogs("pdkv.connector", logging.ERROR) as cm:
            _, _, st = d.run("nd", prompt, 3, dict(kv))
        self.assertEqual(st, RequestStatus.FINISHED_ERROR)  # kv_load_failure_policy fail
        self.assertIn("heterogeneous TP needs the HND KV-cache layout", "\n".join(cm.output))


if __name__ == "__main__":
    unittest.main(verbosity=2)
