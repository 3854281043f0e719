#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Routing and admission by predicted latency (--prefill-policy latency,
proxy/predict.c, proxy/latency.c) against engine-sims of different speeds
(--prefill-us-per-token, --decode-us-per-token) and links (--kv-peer-cost):
the model learns which prefill is fast and which prefill-decode pair has a
slow link, sends a request to decode alone when that is predicted faster,
and refuses or holds a request predicted to miss its TTFT target (x-slo-*
headers, --slo specs per class, GET /admin/latency_model, POST /admin/slo).

Requests are sent one after the other, so what each engine has queued is
known and the choices are the model's alone; where decode alone is not under test, it
is not a choice (--latency-decode-only=false)."""

import json
import time

from pdharness.case import main
from pdharness.client import post_json
from pdharness.ctl import admin, tmpdir, token_file
from pdharness.net import free_port, wait_until
from pdharness.pd import PdCase, prose, rid_headers
from pdharness.procs import run_pdproxy
from pdharness.prom import metric, prom

LAT = ["--prefill-policy", "latency", "--decode-policy", "latency"]
PAIRS = ["--latency-decode-only=false"]  # where decode alone is not under test


class LatencyRoutingTest(PdCase):

    def proxy(self, P, D, extra=(), pairs=True):
        return self.start_proxy([e.port for e in P], [e.port for e in D],
                                extra=LAT + (PAIRS if pairs else []) + list(extra))

    def send(self, px, nbytes, rid, seed, headers=None, stream=False, max_tokens=3, timeout=60):
        h = rid_headers(rid, headers)
        return post_json(px.port, "/v1/completions",
                         {"model": "sim-model", "prompt": prose(nbytes, seed=seed),
                          "max_tokens": max_tokens, "stream": stream},
                         headers=h, timeout=timeout)

    def run_seq(self, px, n, nbytes, prefix, seed0=0, headers=None):
        recs = []
        for i in range(n):
            rid = "%s-%d" % (prefix, i)
            st, _, raw = self.send(px, nbytes, rid, seed0 + i, headers)
            self.assertEqual(st, 200, raw)
            recs.append(self.access_for(px, rid))
        return recs

    def name(self, e):
        return "127.0.0.1:%d" % e.port

    def test_learns_which_prefill_is_fast(self):
        """The slow prefill is listed first and wins the first tie; once
        each was tried, the fast one takes every request (kv_aware, which
        sees two idle engines, sends about half to the slow one)."""
        slow = self.engine("prefill", ["--prefill-us-per-token", "1500"])
        fast = self.engine("prefill", ["--prefill-us-per-token", "150"])
        D = self.engine("decode")
        px = self.proxy([slow, fast], [D])
        recs = self.run_seq(px, 12, 3000, "fast")
        got = [r["prefill"] for r in recs]
        self.assertIn(self.name(slow), got[:3], "the slow one is tried")
        self.assertEqual(got[4:], [self.name(fast)] * 8, got)
        # Every answer is predicted: the access line says what was.
        self.assertTrue(all(float(r["pred_ttft_ms"]) > 0 for r in recs))
        self.assertTrue(all(r["decision"] == "disaggregated" for r in recs))

    def test_learns_the_slow_link_and_admin_views(self):
        """Decode 1's link to prefill a costs 400 ms a fetch: after each
        pair was tried, no request goes over it. GET /admin/latency_model
        shows the pair's KV line; POST /admin/slo changes the targets."""
        pa = self.engine("prefill", ["--engine-id", "pf-a", "--prefill-us-per-token", "100"])
        pb = self.engine("prefill", ["--engine-id", "pf-b", "--prefill-us-per-token", "100"])
        d1 = self.engine("decode", ["--kv-peer-cost", "pf-a=400"])
        d2 = self.engine("decode")
        d = tmpdir(self)
        tokpath, token = token_file(self, d)
        aport = free_port()
        px = self.proxy([pa, pb], [d1, d2],
                        ["--admin-port", str(aport), "--admin-token-file", tokpath])
        recs = self.run_seq(px, 16, 2000, "link")
        pairs = [(r["prefill"], r["decode"]) for r in recs]
        slow = (self.name(pa), self.name(d1))
        self.assertIn(slow, pairs[:8], "the slow pair is tried")
        self.assertNotIn(slow, pairs[8:], pairs)
        st, doc = admin(aport, "GET", "/admin/latency_model", token=token)
        self.assertEqual(st, 200, doc)
        link = [p for p in doc["pairs"] if (p["name"], p["decode"]) == slow]
        self.assertEqual(len(link), 1, doc["pairs"])
        self.assertGreaterEqual(link[0]["kv"]["a"] + link[0]["kv"]["b"] * 400, 0.2)
        fast = [p for p in doc["pairs"] if (p["name"], p["decode"]) != slow]
        self.assertTrue(fast and all(p["kv"]["a"] + p["kv"]["b"] * 400 < 0.2 for p in fast), fast)
        names = {e["name"] for e in doc["engines"]}
        self.assertTrue({self.name(pa), self.name(pb), self.name(d1), self.name(d2)} <= names)
        self.assertGreater(doc["ttft_error"]["predictions"], 0)
        # Targets at run time: every pool gets a TTFT target of 60 s.
        st, doc = admin(aport, "POST", "/admin/slo", {"slo": "pool=*:ttft=60000"}, token=token)
        self.assertEqual(st, 200, doc)
        self.assertEqual(doc["specs"], [{"kind": "pool", "name": "*", "ttft_ms": 60000.0}])
        st, doc = admin(aport, "POST", "/admin/slo", {"slo": "pool=*:ttft=-1"}, token=token)
        self.assertEqual(st, 400, doc)
        for bad in ({}, {"slo": 5}):  # no specs string: refused, the targets kept
            st, doc = admin(aport, "POST", "/admin/slo", bad, token=token)
            self.assertEqual(st, 400, (bad, doc))
            self.assertIn("slo", doc["error"]["message"])
        rec = self.run_seq(px, 1, 2000, "target", seed0=100)[0]
        self.assertEqual((rec["slo_ttft_ms"], rec["slo"]), ("60000", "met"))
        self.assertEqual(metric(prom(px.port), "pdproxy_slo_attained_total", pool="", **{"class": "0"},
                                result="met"), 1)

    def decisions(self, P, D, n=10):
        px = self.proxy([P], [D], pairs=False)
        recs = self.run_seq(px, n, 1600, "dec")
        return px, [r.get("decision_reason") for r in recs]

    def test_decode_alone_when_predicted_faster(self):
        """A slow prefill and a decode quick at prompts: once both paths
        were tried, requests go to decode alone (reason predicted_faster);
        the other way round, they are disaggregated."""
        P = self.engine("prefill", ["--prefill-us-per-token", "2000"])
        D = self.engine("decode", ["--prefill-us-per-token", "100"])
        px, got = self.decisions(P, D)
        self.assertEqual(got[-5:], ["predicted_faster"] * 5, got)
        self.assertGreaterEqual(metric(prom(px.port), "pdproxy_disagg_decisions_total",
                                       decision="decode_only", reason="predicted_faster"), 5)
        P2 = self.engine("prefill", ["--prefill-us-per-token", "100"])
        D2 = self.engine("decode", ["--prefill-us-per-token", "2000"])
        _, got = self.decisions(P2, D2)
        self.assertEqual(got[-5:], ["always"] * 5, got)

    def test_refused_by_prediction_per_class(self):
        """A class whose TTFT target no engine can meet is refused at once
        (its status, Retry-After), before any engine sees it; another
        class's looser target is met. TPOT targets are judged on the
        stream."""
        P = self.engine("prefill", ["--prefill-us-per-token", "1000"])
        D = self.engine("decode", ["--decode-us-per-token", "30000"])
        px = self.proxy([P], [D], ["--priority-class", "interactive:0 batch:1..15",
                                   "--slo", "class=interactive:ttft=200:miss=refuse:status=429 "
                                            "class=batch:ttft=60000:miss=refuse"])
        self.run_seq(px, 2, 3200, "learn", headers={"x-priority": "batch"})
        seen = metric(prom(P.port), "engine_sim_requests_total")
        t0 = time.monotonic()
        st, h, raw = self.send(px, 3200, "hot", 50, {"x-priority": "interactive"})
        self.assertLess(time.monotonic() - t0, 0.5, "refused before any engine worked")
        self.assertEqual(st, 429, raw)
        self.assertGreaterEqual(int(h["Retry-After"]), 1)
        self.assertIn("misses the target of 200 ms", json.loads(raw)["error"]["message"])
        rec = self.access_for(px, "hot")
        self.assertEqual((rec["slo"], rec["slo_ttft_ms"], rec["status"]), ("refused", "200", "429"))
        self.assertEqual(metric(prom(P.port), "engine_sim_requests_total"), seen)
        self.assertEqual(metric(prom(px.port), "pdproxy_slo_attained_total", pool="",
                                **{"class": "interactive"}, result="refused"), 1)
        # A header's target wins over the class's.
        st, _, raw = self.send(px, 3200, "hdr", 51, {"x-priority": "interactive",
                                                     "x-slo-ttft-ms": "30000"})
        self.assertEqual(st, 200, raw)
        self.assertEqual(self.access_for(px, "hdr")["slo"], "met")
        # TPOT: 30 ms between tokens misses 10 ms, meets 300 ms.
        for rid, tpot, want in (("tp-miss", "10", "missed"), ("tp-met", "300", "met")):
            st, _, raw = self.send(px, 400, rid, 60, {"x-priority": "batch", "x-slo-tpot-ms": tpot},
                                   stream=True, max_tokens=5)
            self.assertEqual(st, 200, raw)
            rec = self.access_for(px, rid)
            self.assertEqual((rec["slo"], rec["slo_tpot_ms"]), (want, tpot), rec)
        s = prom(px.port)
        self.assertEqual(metric(s, "pdproxy_slo_attained_total", pool="", **{"class": "batch"},
                                result="missed"), 1)

    def test_waits_for_its_prediction_if_the_deadline_allows(self):
        """A long prompt occupies the only prefill; a short one with a
        600 ms target is predicted to miss it: with miss=queue it waits in
        the admission queue (behind every request that can meet its
        target) until the prefill is about idle, then goes; with a queue
        deadline shorter than the predicted wait it is refused at once."""
        P = self.engine("prefill", ["--prefill-us-per-token", "1000"])
        D = self.engine("decode")
        px = self.proxy([P], [D], ["--slo-miss", "queue", "--queue-max", "16"])
        for i, n in enumerate((400, 1600, 800, 2400)):  # the prefill's seconds per token
            st, _, raw = self.send(px, n, "learn-%d" % i, i)
            self.assertEqual(st, 200, raw)
        import threading
        out = {}

        def long():
            out["long"] = self.send(px, 12000, "long", 70)
        t = threading.Thread(target=long)
        t.start()
        self.addCleanup(t.join, 60)
        self.assertTrue(wait_until(lambda: metric(prom(P.port), "vllm:num_requests_running") == 1,
                                   10, 0.01))
        st, h, raw = self.send(px, 400, "short-refused", 71,
                               {"x-slo-ttft-ms": "600", "x-queue-timeout": "0.3"})
        self.assertEqual(st, 503, raw)
        self.assertIn("Retry-After", h)
        st, _, raw = self.send(px, 400, "short", 72, {"x-slo-ttft-ms": "600"})
        self.assertEqual(st, 200, raw)
        t.join(60)
        self.assertEqual(out["long"][0], 200, out["long"][2])
        rec, lrec = self.access_for(px, "short"), self.access_for(px, "long")
        # It waited for the long prompt's prefill, and was computed after it.
        self.assertGreater(float(rec["queue_ms"]), 1000, rec)
        self.assertGreaterEqual(float(rec["ttfb_ms"]), float(lrec["prefill_ms"]) - 50)
        self.assertEqual(rec["slo"], "missed")
        self.assertEqual(self.access_for(px, "short-refused")["slo"], "refused")

    def test_bad_slo_spec_refused_at_start(self):
        p = run_pdproxy(["--slo", "class=x:ttft=fast"])
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--slo", p.stderr)


if __name__ == "__main__":
    main()
