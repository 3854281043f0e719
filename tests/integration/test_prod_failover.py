#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 5 items 3 and 4: failover and decode-only fallback.

* P refused, reset or 5xx: the request is retried on another P, at most
  --prefill-retries times; a 4xx is the client's answer, never retried.
* D refused (nothing sent): another D. D that read the body (then reset,
  closed, or answered and died): 502 or a cut stream, and no other D ever
  receives that request (D may already have pulled P's blocks).
* --fallback-decode-only: with every P ejected, D gets the request without
  kv_transfer_params; without the flag, 503."""

import json
import unittest

from pdharness.client import RawClient, errmsg, http_request
from pdharness.mocks import (PREFILL_KV, CloseBeforeHeaders, MockBackend, Reset, Respond, Stream,
                             chat_body, completion_body, decode_handler, default_p_kv,
                             prefill_handler, request_ids, sse_events, sans_xfer)
from pdharness.net import closed_port
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom

NO_EJECT = ["--unhealthy-after", "1000"]


def p500(req):
    return Respond(500, [("Content-Type", "application/json")],
                   b'{"error":{"message":"engine crashed"}}')


def p503(req):
    return Respond(503, [("Content-Type", "application/json")], b'{"error":"overloaded"}')


class PrefillFailoverTest(ProdCase):
    def check_failover(self, bad, kind):
        """bad: a MockBackend or a closed port standing for the failing P."""
        P1 = self.mock(prefill_handler(kv=default_p_kv("good", 7)), name="Pgood")
        D = self.mock(decode_handler(), name="D")
        px = self.start([bad, P1], [D], NO_EJECT + ["--prefill-retries", "2"])
        ids = ["%s-%d" % (kind, i) for i in range(4)]
        for rid in ids:
            r = self.post(px, headers={"X-Request-Id": rid})
            self.assertEqual(r.status, 200, "%s: request %s not failed over: %r" % (kind, rid, r))
        # Round robin sends every other request to the bad one first.
        self.assertEqual(sorted(request_ids(P1)), sorted(ids), "every request ends on the good P")
        self.assertEqual(sorted(request_ids(D)), sorted(ids), "D gets each request once")
        for req in D.requests:
            self.assertEqual(req.json()["kv_transfer_params"]["remote_engine_id"], "engine-p-7",
                             "D got the params of the P that answered")
        # Each attempt on the bad one is followed by exactly one retry. (The
        # round-robin cursor moves past the instance that answered, so every
        # request may try the bad one first: not ejected here.)
        samples = prom(px.port)
        bad_name = self.bname(bad) if isinstance(bad, MockBackend) else "127.0.0.1:%d" % bad
        attempts = sum(metric(samples, "pdproxy_upstream_requests_total", role="prefill",
                              backend=bad_name, outcome=o) or 0
                       for o in ("connect_error", "reset", "server_error"))
        self.assertGreaterEqual(attempts, 2, "round robin tried the bad prefill")
        self.assertEqual(metric(samples, "pdproxy_retries_total", role="prefill"), attempts)
        if isinstance(bad, MockBackend):
            self.assertEqual(len(bad.requests), attempts)
            for req in bad.requests:
                self.assertIn(req.header("x-request-id"), ids)
                self.assertEqual(sans_xfer(req.json()["kv_transfer_params"]), PREFILL_KV)

    def test_prefill_refused_retried_on_another(self):
        self.check_failover(closed_port(), "refused")

    def test_prefill_reset_retried_on_another(self):
        self.check_failover(self.mock(lambda req: Reset(), name="Preset"), "reset")

    def test_prefill_closed_without_answer_retried(self):
        self.check_failover(self.mock(lambda req: CloseBeforeHeaders(), name="Pclose"), "closed")

    def test_prefill_5xx_retried_on_another(self):
        self.check_failover(self.mock(p500, name="P500"), "5xx")

    def test_prefill_retries_bounded(self):
        for retries in (0, 1, 2, 3):
            with self.subTest(retries=retries):
                Ps = [self.mock(p503, name="P%d_%d" % (retries, i)) for i in range(5)]
                D = self.mock(decode_handler(), name="D%d" % retries)
                px = self.start(Ps, [D], NO_EJECT + ["--prefill-retries", str(retries)])
                r = self.post(px, headers={"X-Request-Id": "bounded-%d" % retries})
                self.assertErrorJson(r, 502)
                tried = [m for m in Ps for _ in m.requests]
                self.assertEqual(len(tried), retries + 1,
                                 "--prefill-retries %d: prefill attempts %r"
                                 % (retries, [len(m.requests) for m in Ps]))
                self.assertEqual(len(set(tried)), retries + 1, "each retry on another instance")
                self.assertEqual(D.requests, [])
                px._expected_exit = True
                px.stop()

    def test_prefill_retries_back_off(self):
        """Retries are spaced by a (jittered) backoff, not fired at once."""
        Ps = [self.mock(p503, name="P%d" % i) for i in range(4)]
        D = self.mock(decode_handler(), name="D")
        px = self.start(Ps, [D], NO_EJECT + ["--prefill-retries", "3"])
        self.assertErrorJson(self.post(px), 502)
        starts = sorted(r.t_start for m in Ps for r in m.requests)
        self.assertEqual(len(starts), 4)
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        self.assertTrue(all(g >= 0.003 for g in gaps), "retry gaps %r s" % gaps)
        self.assertGreaterEqual(starts[-1] - starts[0], 0.015,
                                "three retries within %.1f ms: no backoff"
                                % ((starts[-1] - starts[0]) * 1e3))
        self.assertLess(starts[-1] - starts[0], 2.0, "backoff far too long: %r" % gaps)

    def test_prefill_4xx_not_retried(self):
        P0 = self.mock(lambda req: Respond(400, [("Content-Type", "application/json")],
                                           b'{"error":{"message":"prompt too long"}}'), name="P0")
        P1 = self.mock(prefill_handler(), name="P1")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P0, P1], [D], NO_EJECT)
        r = self.post(px)
        self.assertEqual(r.status, 400)
        self.assertEqual(r.body, b'{"error":{"message":"prompt too long"}}')
        self.assertEqual((len(P0.requests), len(P1.requests), len(D.requests)), (1, 0, 0))


class DecodeFailoverTest(ProdCase):
    def test_decode_refused_tries_another(self):
        P = self.mock(prefill_handler(), name="P")
        D1 = self.mock(decode_handler(), name="D1")
        dead = closed_port()
        px = self.start([P], [dead, D1], NO_EJECT)
        ids = ["dref-%d" % i for i in range(4)]
        for rid in ids:
            r = self.post(px, headers={"X-Request-Id": rid})
            self.assertEqual(r.status, 200, r)
        self.assertEqual(sorted(request_ids(D1)), sorted(ids))
        self.assertEqual(len(P.requests), 4, "a decode retry does not redo the prefill")
        samples = prom(px.port)
        attempts = metric(samples, "pdproxy_upstream_requests_total", role="decode",
                          backend="127.0.0.1:%d" % dead, outcome="connect_error")
        self.assertGreaterEqual(attempts, 2)
        self.assertEqual(metric(samples, "pdproxy_retries_total", role="decode"), attempts)

    def check_never_resent(self, bad_action, expect_status):
        P = self.mock(prefill_handler(), name="P")
        Dbad = self.mock(lambda req: bad_action(), name="Dbad")
        Dok = self.mock(decode_handler(), name="Dok")
        px = self.start([P], [Dbad, Dok], NO_EJECT)
        results = {}
        for i in range(6):
            rid = "once-%d" % i
            c = RawClient(px.port)
            try:
                c.request("POST", "/v1/completions", completion_body(),
                          [("X-Request-Id", rid)])
                results[rid] = c.read_response(timeout=10)
            finally:
                c.close()
        bad_ids = set(request_ids(Dbad))
        ok_ids = set(request_ids(Dok))
        self.assertEqual(len(bad_ids), 3, "round robin gives the failing decode half: %r" % bad_ids)
        self.assertEqual(bad_ids & ok_ids, set(),
                         "a request that reached a decode was sent to another decode")
        self.assertEqual(len(Dok.requests), 3)
        for rid, resp in results.items():
            if rid in bad_ids:
                if expect_status == 502:
                    self.assertErrorJson(resp, 502, "request %s" % rid)
                else:  # headers went out, then the stream was cut
                    self.assertEqual(resp.status, expect_status)
                    self.assertFalse(resp.complete, "a failed stream must not look complete")
            else:
                self.assertEqual(resp.status, 200)
        self.assertEqual(metric(prom(px.port), "pdproxy_retries_total", role="decode"), 0)

    def test_decode_read_body_then_reset_not_resent(self):
        self.check_never_resent(lambda: Reset(), 502)

    def test_decode_read_body_then_reset_after_delay_not_resent(self):
        self.check_never_resent(lambda: Reset(delay=0.2), 502)

    def test_decode_read_body_then_closed_not_resent(self):
        self.check_never_resent(lambda: CloseBeforeHeaders(), 502)

    def test_decode_answered_then_died_not_resent(self):
        self.check_never_resent(
            lambda: Stream(200, [("Content-Type", "text/event-stream")],
                           [(0, sse_events(["a"], done=False)[0])], end="reset"), 200)


class FallbackTest(ProdCase):
    def start_all_p_ejected(self, fallback):
        P = self.mock(prefill_handler(), name="P")
        P.probe_handler = lambda req: Respond(503, [], b"")
        D = self.mock(decode_handler(), name="D")
        extra = ["--health-interval", "0.1", "--unhealthy-after", "1"]
        if fallback:
            extra.append("--fallback-decode-only")
        px = self.start([P], [D], extra, health_interval=None)
        self.wait_up(px, "prefill", P, 0, 3.0)
        return P, D, px

    def test_fallback_sends_decode_alone_without_kv_params(self):
        P, D, px = self.start_all_p_ejected(True)
        cases = [("/v1/completions", completion_body(stream=False)),
                 ("/v1/chat/completions", chat_body()),
                 ("/v1/completions", completion_body(
                     kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.9.9.9",
                                         "remote_port": 1, "remote_request_id": "client"}))]
        for i, (path, body) in enumerate(cases):
            with self.subTest(path=path, i=i):
                r = self.post(px, body, path=path, headers={"X-Request-Id": "fb-%d" % i})
                self.assertEqual(r.status, 200, r)
                self.assertEqual(r.json()["choices"][0]["text"], "decoded:%d" % i)
                got = D.requests[i]
                self.assertEqual(got.path, path)
                self.assertEqual(got.header("x-request-id"), "fb-%d" % i)
                doc = got.json()
                self.assertNotIn("kv_transfer_params", doc,
                                 "decode-only fallback must not send kv_transfer_params")
                want = dict(body)
                want.pop("kv_transfer_params", None)
                self.assertEqual(doc, want, "D gets the client's request otherwise unchanged")
        self.assertEqual(P.requests, [], "an ejected prefill received requests")
        rd = http_request(px.port, "GET", "/ready")
        self.assertEqual(rd.status, 200, rd)

    def test_fallback_streams(self):
        P, D, px = self.start_all_p_ejected(True)
        events = sse_events(["x", "y"])
        D.set_handler(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         [(0, e) for e in events]))
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body(stream=True))
        resp = c.read_response(timeout=10)
        c.close()
        self.assertEqual(resp.status, 200)
        self.assertTrue(resp.complete)
        self.assertEqual(bytes(resp.body), b"".join(events))
        self.assertTrue(D.requests[0].json()["stream"])

    def test_without_fallback_503(self):
        P, D, px = self.start_all_p_ejected(False)
        r = self.post(px)
        self.assertErrorJson(r, 503)
        self.assertIn("prefill", errmsg(r).lower())
        self.assertEqual(D.requests, [], "without --fallback-decode-only D must not be called")
        self.assertEqual(P.requests, [])


if __name__ == "__main__":
    unittest.main(verbosity=2)
