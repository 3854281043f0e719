#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""engine-sim's speeds, so that routing by predicted latency can be tested:
--decode-us-per-token (time between output tokens, finer than --itl-ms) and
--kv-peer-cost (what fetching KV from one prefill costs a decode: a delay and
a bandwidth cap per link, keyed by the prefill's engine id or KV address).
Decode's X-KV-Wait-Ms includes the link's cost, as it would a slow network.
Lower bounds only: a loaded machine is slower, never faster."""

import json
import time

from pdharness.case import main
from pdharness.client import post_json
from pdharness.pd import PdCase, prose, rid_headers
from pdharness.prom import metric, prom


class SimSpeedTest(PdCase):

    def prefill(self, port, prompt, rid):
        st, _, raw = post_json(port, "/v1/completions",
                               {"model": "sim-model", "prompt": prompt, "max_tokens": 1,
                                "kv_transfer_params": {"do_remote_decode": True}},
                               headers=rid_headers(rid))
        self.assertEqual(st, 200, raw)
        return json.loads(raw)["kv_transfer_params"]

    def decode(self, port, prompt, kvp, rid):
        """X-KV-Wait-Ms of decode given prefill's kv_transfer_params."""
        st, h, raw = post_json(port, "/v1/completions",
                               {"model": "sim-model", "prompt": prompt, "max_tokens": 2,
                                "kv_transfer_params": kvp}, headers=rid_headers(rid))
        self.assertEqual(st, 200, raw)
        return float(h["X-KV-Wait-Ms"])

    def test_decode_us_per_token_spaces_tokens(self):
        E = self.engine("both", ["--decode-us-per-token", "40000"])
        t0 = time.monotonic()
        st, _, raw = post_json(E.port, "/v1/completions",
                               {"model": "sim-model", "prompt": "hello there", "max_tokens": 6,
                                "stream": True})
        took = time.monotonic() - t0
        self.assertEqual(st, 200, raw)
        self.assertEqual(raw.count(b"data: {"), 6)
        self.assertGreaterEqual(took, 5 * 0.040)

    def test_bad_peer_cost_refused(self):
        from pdharness.procs import ENGINE_SIM
        import subprocess
        for bad in ("nopeer", "p=-1", "p=5/x", "=5"):
            r = subprocess.run([ENGINE_SIM, "--kv-peer-cost", bad], capture_output=True,
                               timeout=30)
            self.assertEqual(r.returncode, 2, bad)
            self.assertIn(b"--kv-peer-cost", r.stderr)

    def test_kv_link_delay_by_prefill(self):
        # Two prefills; decode's link to the slow one adds 600 ms per fetch.
        fast = self.engine("prefill", ["--engine-id", "pf-fast"])
        slow = self.engine("prefill", ["--engine-id", "pf-slow"])
        D = self.engine("decode", ["--kv-peer-cost", "pf-slow=600"])
        prompt = prose(600, seed=1)
        w_fast = self.decode(D.port, prompt, self.prefill(fast.port, prompt, "f"), "df")
        w_slow = self.decode(D.port, prompt, self.prefill(slow.port, prompt, "s"), "ds")
        self.assertGreaterEqual(w_slow, 600)
        self.assertLess(w_fast, w_slow)
        s = prom(D.port)
        self.assertEqual(metric(s, "engine_sim_kv_link_delays_total"), 1)
        self.assertGreater(metric(s, "engine_sim_kv_link_delay_seconds_total"), 0.5)

    def test_kv_link_bandwidth_queues(self):
        # Any prefill: 1 MB/s. Two fetches at once share the link: the
        # second lands after both have crossed it.
        P = self.engine("prefill")
        D = self.engine("decode", ["--kv-peer-cost", "*=0/1"])
        prompts = [prose(3000, seed=s) for s in (2, 3)]
        kvps = [self.prefill(P.port, p, "p%d" % i) for i, p in enumerate(prompts)]
        import threading
        waits = {}

        def run(i):
            waits[i] = self.decode(D.port, prompts[i], kvps[i], "d%d" % i)
        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        # A failure inside a thread only prints: both decodes must have ended.
        self.assertFalse(any(t.is_alive() for t in ts))
        self.assertEqual(len(waits), 2, waits)
        nbytes = metric(prom(D.port), "engine_sim_kv_bytes_fetched_total")
        self.assertGreater(nbytes, 100000)
        # Both together took at least all bytes at 1 MB/s.
        self.assertGreaterEqual(max(waits.values()), nbytes / 1e6 * 1e3 * 0.99)
        self.assertEqual(metric(prom(D.port), "engine_sim_kv_link_delays_total"), 2)


if __name__ == "__main__":
    main()
