#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""engine-sim's queueing on /metrics (what bench/pd_mixed.py reports as
decode's queueing time): engine_sim_queue_seconds_total and
engine_sim_queue_entries_total, per queue.  kv_blocks: a request that finds
too few free KV blocks waits in the wait queue until a finished one frees
them; compute: the engine computes one prompt at a time, so a prompt (or a
decode's last prompt token) waits for those queued before it; seqs: with
--max-num-seqs N (vLLM's cap of running sequences), a request whose prompt is
ready (computed, or its KV received from prefill) waits while N others
generate.  An idle engine waits for nothing: exactly 0."""

import json
import threading
import time

from pdharness.case import main
from pdharness.client import post_json
from pdharness.net import wait_until
from pdharness.pd import PdCase, prose, rid_headers
from pdharness.prom import metric, prom


class SimQueueTest(PdCase):

    def queues(self, port):
        s = prom(port)
        return {q: (metric(s, "engine_sim_queue_seconds_total", queue=q),
                    metric(s, "engine_sim_queue_entries_total", queue=q))
                for q in ("kv_blocks", "compute", "seqs")}

    def complete(self, port, prompt, rid, max_tokens=2, out=None):
        st, _, raw = post_json(port, "/v1/completions",
                               {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens},
                               headers=rid_headers(rid))
        if out is not None:
            out[rid] = (st, raw)
        return st, raw

    def tokens(self, port, prompt):
        st, _, raw = post_json(port, "/tokenize", {"model": "sim-model", "prompt": prompt})
        self.assertEqual(st, 200, raw)
        return json.loads(raw)["count"]

    def in_background(self, *args, **kw):
        t = threading.Thread(target=self.complete, args=args, kwargs=kw)
        t.start()
        self.addCleanup(t.join, 60)
        return t

    def test_idle_engine_waits_for_nothing(self):
        E = self.engine("both", ["--prefill-us-per-token", "200"])
        self.assertEqual(self.queues(E.port),
                         {"kv_blocks": (0, 0), "compute": (0, 0), "seqs": (0, 0)})
        for i in range(2):  # one after the other: the first is computed before the second comes
            st, raw = self.complete(E.port, prose(800, seed=i), "idle-%d" % i)
            self.assertEqual(st, 200, raw)
        self.assertEqual(self.queues(E.port),
                         {"kv_blocks": (0, 2), "compute": (0, 2), "seqs": (0, 2)})

    def test_prompt_waits_behind_the_one_computed(self):
        us = 2000
        E = self.engine("both", ["--prefill-us-per-token", str(us)])
        long_prompt, short = prose(16000, seed=3), prose(300, seed=4)
        n_long = self.tokens(E.port, long_prompt)
        self.assertGreater(n_long * us / 1e6, 3.0, "the long prompt must take a few seconds")
        out = {}
        t = self.in_background(E.port, long_prompt, "long", out=out)
        self.assertTrue(wait_until(lambda: metric(prom(E.port), "vllm:num_requests_running") == 1,
                                   10, 0.01))
        st, raw = self.complete(E.port, short, "short")
        self.assertEqual(st, 200, raw)
        t.join(60)
        self.assertEqual(out["long"][0], 200, out["long"][1])
        (bw, bn), (cw, cn) = self.queues(E.port)["kv_blocks"], self.queues(E.port)["compute"]
        self.assertEqual((bw, bn, cn), (0, 2, 2))
        # The short prompt came while the long one was computed: it waited for
        # the rest of it, never more than all of it.
        self.assertGreater(cw, 0)
        self.assertLessEqual(cw, n_long * us / 1e6)

    def test_request_waits_for_kv_blocks(self):
        # 16 blocks of 16 tokens: a prompt of 129..256 tokens takes more than
        # half of them, so the second waits until the first has finished.
        E = self.engine("both", ["--num-blocks", "16", "--itl-ms", "50"])
        a, b = prose(1000, seed=5), prose(1000, seed=6)
        for p in (a, b):
            n = self.tokens(E.port, p)
            self.assertTrue(128 < n <= 256, n)
        out = {}
        t = self.in_background(E.port, a, "first", max_tokens=20, out=out)
        self.assertTrue(wait_until(lambda: metric(prom(E.port), "vllm:num_requests_running") == 1,
                                   10, 0.01))
        t0 = time.monotonic()
        st, raw = self.complete(E.port, b, "second", max_tokens=2, out=out)
        waited_at_most = time.monotonic() - t0
        self.assertEqual(st, 200, raw)
        t.join(60)
        self.assertEqual(out["first"][0], 200, out["first"][1])
        bw, bn = self.queues(E.port)["kv_blocks"]
        self.assertEqual(bn, 2)
        self.assertGreater(bw, 0)
        self.assertLessEqual(bw, waited_at_most)

    def wait_generating(self, port, n):
        """Until n generations have started (each took a slot, or waited)."""
        self.assertTrue(wait_until(
            lambda: metric(prom(port), "engine_sim_queue_entries_total", queue="seqs") == n,
            10, 0.01))

    def test_request_waits_for_a_generation_slot(self):
        # One slot: the second request, its prompt computed, waits while the
        # first generates its 20 tokens 50 ms apart; the pool has room.
        E = self.engine("both", ["--max-num-seqs", "1", "--itl-ms", "50"])
        out = {}
        t = self.in_background(E.port, prose(400, seed=7), "first", max_tokens=20, out=out)
        self.wait_generating(E.port, 1)
        t0 = time.monotonic()
        st, raw = self.complete(E.port, prose(400, seed=8), "second", max_tokens=2)
        waited_at_most = time.monotonic() - t0
        self.assertEqual(st, 200, raw)
        self.assertEqual(len(json.loads(raw)["choices"][0]["text"].split()), 2)
        t.join(60)
        self.assertEqual(out["first"][0], 200, out["first"][1])
        q = self.queues(E.port)
        self.assertEqual((q["kv_blocks"], q["seqs"][1]), ((0, 2), 2))
        self.assertGreater(q["seqs"][0], 0)
        self.assertLessEqual(q["seqs"][0], waited_at_most)

    def test_decode_waits_for_a_slot_after_its_kv_arrived(self):
        # A P/D pair through pdproxy: decode's only slot is taken by the first
        # request's generation, so the second's KV is fetched and verified,
        # and then it waits for the slot.
        P = self.engine("prefill")
        D = self.engine("decode", ["--max-num-seqs", "1", "--itl-ms", "50"])
        px = self.start_proxy([P.port], [D.port], extra=["--disagg-min-tokens", "0"])
        out = {}
        t = self.in_background(px.port, prose(400, seed=9), "first", max_tokens=20, out=out)
        self.wait_generating(D.port, 1)
        t0 = time.monotonic()
        st, raw = self.complete(px.port, prose(400, seed=10), "second", max_tokens=2)
        waited_at_most = time.monotonic() - t0
        self.assertEqual(st, 200, raw)
        t.join(60)
        self.assertEqual(out["first"][0], 200, out["first"][1])
        s = prom(D.port)
        self.assertEqual(metric(s, "engine_sim_kv_fetches_total"), 2)
        # Each computed only its last prompt token: the KV came from prefill.
        self.assertEqual(metric(s, "engine_sim_prompt_tokens_computed_total"), 2)
        q = self.queues(D.port)
        self.assertEqual(q["seqs"][1], 2)
        self.assertGreater(q["seqs"][0], 0)
        self.assertLessEqual(q["seqs"][0], waited_at_most)
        # Prefill, whose requests generate nothing beyond their one token,
        # has no cap and waited for no slot.
        self.assertEqual(self.queues(P.port)["seqs"][0], 0)


if __name__ == "__main__":
    main()
