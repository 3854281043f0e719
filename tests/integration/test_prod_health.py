#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 5 item 2, health: active checks (GET /health every
--health-interval; ejected after --unhealthy-after failures, readmitted after
--healthy-after successes), passive ejection on connect errors, resets and
5xx, never on 4xx; what /ready and the errors say when a role has no backend
left."""

import threading
import time
import unittest

from pdharness.client import errmsg, http_request
from pdharness.mocks import (CloseBeforeHeaders, Hang, Reset, Respond, decode_handler,
                             default_probe_handler, prefill_handler)
from pdharness.net import closed_port, now, wait_value
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom


class ScriptedHealth:
    """Probe handler whose /health status the test switches; it records each
    answered check as (time, status) after choosing the status, so the tail
    of `answered` is what pdproxy has seen (or is about to see)."""

    def __init__(self, status=200):
        self.status = status
        self.answered = []
        self.lock = threading.Lock()

    def __call__(self, req):
        if req.path.startswith("/metrics"):
            return default_probe_handler(req)
        with self.lock:
            st = self.status
            self.answered.append((now(), st))
        return Respond(st, [("Content-Type", "application/json")], b"{}")

    def set(self, status):
        with self.lock:
            self.status = status

    def tail_run(self, status):
        """How many of the last answered checks in a row had `status`."""
        with self.lock:
            n = 0
            for _, st in reversed(self.answered):
                if st != status:
                    break
                n += 1
            return n

    def count(self):
        with self.lock:
            return len(self.answered)


def with_health(mock, status=200):
    h = ScriptedHealth(status)
    mock.probe_handler = h
    return h


class ActiveHealthTest(ProdCase):
    INTERVAL = 0.2

    def active_flags(self, unhealthy=3, healthy=2):
        return ["--health-interval", str(self.INTERVAL), "--health-timeout", "0.5",
                "--unhealthy-after", str(unhealthy), "--healthy-after", str(healthy)]

    def watch_until(self, px, role, mock, want, timeout, on_first):
        """Polls pdproxy_backend_up every 10 ms; calls on_first() at the
        first poll that sees `want` (before anything else can change)."""
        last = wait_value(lambda: self.up(px, role, mock), lambda v: v == want, timeout, 0.01)
        if last == want:
            return on_first()
        self.fail("pdproxy_backend_up{role=%s,backend=%s} stayed %r, wanted %r"
                  % (role, self.bname(mock), last, want))

    def test_prefill_ejected_after_unhealthy_after_then_readmitted(self):
        P0 = self.mock(prefill_handler(), name="P0")
        P1 = self.mock(prefill_handler(), name="P1")
        D = self.mock(decode_handler(), name="D")
        h1 = with_health(P1, 200)
        px = self.start([P0, P1], [D], self.active_flags(3, 2), health_interval=None)
        self.assertEqual(P1.wait_probes(2, 5.0) >= 2, True, "no active checks reached P1")
        self.assertEqual(self.up(px, "prefill", P1), 1)

        h1.set(503)
        t_fail = now()
        run = self.watch_until(px, "prefill", P1, 0, 3.0, lambda: h1.tail_run(503))
        took = now() - t_fail
        self.assertGreaterEqual(run, 3, "ejected after %d failed checks (--unhealthy-after 3)"
                                % run)
        self.assertLess(took, 3 * self.INTERVAL + 1.5, "ejection took %.2fs" % took)

        # Ejected: no traffic at all.
        n1 = len(P1.requests)
        for i in range(6):
            r = self.post(px)
            self.assertEqual(r.status, 200, r)
        self.assertEqual(len(P1.requests), n1, "an ejected prefill received requests")
        self.assertGreaterEqual(len(P0.requests), 6)

        h1.set(200)
        run = self.watch_until(px, "prefill", P1, 1, 3.0, lambda: h1.tail_run(200))
        self.assertGreaterEqual(run, 2, "readmitted after %d good checks (--healthy-after 2)"
                                % run)
        for i in range(6):
            self.assertEqual(self.post(px).status, 200)
        self.assertGreaterEqual(len(P1.requests) - n1, 2, "a readmitted prefill gets traffic")

    def test_decode_ejected_by_health_check_gets_no_traffic(self):
        P = self.mock(prefill_handler(), name="P")
        D0 = self.mock(decode_handler(), name="D0")
        D1 = self.mock(decode_handler(), name="D1")
        h = with_health(D1, 500)
        px = self.start([P], [D0, D1], self.active_flags(2, 2), health_interval=None)
        run = self.watch_until(px, "decode", D1, 0, 3.0, lambda: h.tail_run(500))
        self.assertGreaterEqual(run, 2)
        n0, n1 = len(D0.requests), len(D1.requests)
        for i in range(6):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual(len(D1.requests), n1, "an ejected decode received requests")
        self.assertEqual(len(D0.requests) - n0, 6)

    def test_health_check_timeout_counts_as_failure(self):
        P0 = self.mock(prefill_handler(), name="P0")
        P1 = self.mock(prefill_handler(), name="P1")
        D = self.mock(decode_handler(), name="D")
        P1.probe_handler = lambda req: Hang(5.0)
        px = self.start([P0, P1], [D], ["--health-interval", "0.2", "--health-timeout", "0.2",
                                        "--unhealthy-after", "2"], health_interval=None)
        self.wait_up(px, "prefill", P1, 0, 4.0)

    def test_every_prefill_ejected_error_and_ready_say_so(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        with_health(P, 503)
        px = self.start([P], [D], self.active_flags(1, 2), health_interval=None)
        self.wait_up(px, "prefill", P, 0, 3.0)
        r = self.post(px)
        self.assertErrorJson(r, 503)
        msg = errmsg(r).lower()
        self.assertIn("prefill", msg)
        self.assertIn("ejected", msg)
        self.assertTrue(r.header("retry-after"), "503 without Retry-After: %r" % r.headers)
        self.assertEqual(P.requests, [])
        self.assertEqual(D.requests, [])
        rd = http_request(px.port, "GET", "/ready")
        doc = rd.json()
        self.assertEqual(doc["prefill"], {"healthy": 0, "total": 1}, doc)
        self.assertIn("prefill", doc.get("reason", ""), doc)
        self.assertIn("ejected", doc.get("reason", ""), doc)

    def test_every_decode_ejected_ready_503_and_error_say_so(self):
        P = self.mock(prefill_handler(), name="P")
        D0 = self.mock(decode_handler(), name="D0")
        D1 = self.mock(decode_handler(), name="D1")
        with_health(D0, 503)
        with_health(D1, 503)
        px = self.start([P], [D0, D1], self.active_flags(1, 2), health_interval=None)
        self.wait_up(px, "decode", D0, 0, 3.0)
        self.wait_up(px, "decode", D1, 0, 3.0)
        rd = http_request(px.port, "GET", "/ready")
        self.assertEqual(rd.status, 503, rd)
        doc = rd.json()
        self.assertEqual(doc["decode"], {"healthy": 0, "total": 2}, doc)
        self.assertIn("decode", doc.get("reason", ""), doc)
        self.assertIn("ejected", doc.get("reason", ""), doc)
        r = self.post(px)
        self.assertErrorJson(r, 503)
        msg = errmsg(r).lower()
        self.assertIn("decode", msg)
        self.assertIn("ejected", msg)
        self.assertEqual(D0.requests + D1.requests, [])


class PassiveHealthTest(ProdCase):
    """No active checks (--health-interval 0): only what requests see counts.
    An ejected backend is tried again after a backoff of 1 s, so each test
    checks "no traffic" within that second."""

    def flags(self, unhealthy=2):
        return ["--unhealthy-after", str(unhealthy), "--prefill-retries", "2"]

    def outcome(self, px, role, mock, outcome):
        return metric(prom(px.port), "pdproxy_upstream_requests_total", role=role,
                      backend=self.bname(mock), outcome=outcome) or 0

    def check_prefill_ejection(self, bad_handler, outcome):
        P0 = self.mock(bad_handler, name="Pbad")
        P1 = self.mock(prefill_handler(), name="Pgood")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P0, P1], [D], self.flags(2))
        seen = 0
        for i in range(6):
            r = self.post(px)
            self.assertEqual(r.status, 200, "request %d: failover to the good prefill: %r" % (i, r))
            if self.up(px, "prefill", P0) == 0:
                break
        self.assertEqual(self.up(px, "prefill", P0), 0, "not ejected after %s" % outcome)
        self.assertEqual(len(P0.requests), 2, "ejected after exactly --unhealthy-after 2 failures")
        self.assertEqual(self.outcome(px, "prefill", P0, outcome), 2)
        for i in range(4):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual(len(P0.requests), 2, "an ejected prefill received requests")

    def test_prefill_5xx_ejects(self):
        self.check_prefill_ejection(lambda req: Respond(503, [("Content-Type", "application/json")],
                                                        b'{"error":"overloaded"}'),
                                    "server_error")

    def test_prefill_reset_ejects(self):
        self.check_prefill_ejection(lambda req: Reset(), "reset")

    def test_prefill_connect_error_ejects(self):
        P1 = self.mock(prefill_handler(), name="Pgood")
        D = self.mock(decode_handler(), name="D")
        dead = closed_port()
        px = self.start([dead, P1], [D], self.flags(2))

        def dead_up():
            return metric(prom(px.port), "pdproxy_backend_up", role="prefill",
                          backend="127.0.0.1:%d" % dead)

        def dead_out():
            return metric(prom(px.port), "pdproxy_upstream_requests_total", role="prefill",
                          backend="127.0.0.1:%d" % dead, outcome="connect_error") or 0

        for i in range(6):
            self.assertEqual(self.post(px).status, 200)
            if dead_up() == 0:
                break
        self.assertEqual(dead_up(), 0)
        self.assertEqual(dead_out(), 2)
        retries = metric(prom(px.port), "pdproxy_retries_total", role="prefill")
        for i in range(4):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual(dead_out(), 2, "an ejected prefill was tried again within its backoff")
        self.assertEqual(metric(prom(px.port), "pdproxy_retries_total", role="prefill"), retries)

    def test_decode_5xx_ejects(self):
        P = self.mock(prefill_handler(), name="P")
        D0 = self.mock(decode_handler(status=500), name="D0")
        D1 = self.mock(decode_handler(), name="D1")
        px = self.start([P], [D0, D1], self.flags(2))
        statuses = []
        for i in range(6):
            statuses.append(self.post(px).status)
            if self.up(px, "decode", D0) == 0:
                break
        self.assertEqual(self.up(px, "decode", D0), 0, "statuses %r" % statuses)
        self.assertEqual(len(D0.requests), 2)
        for i in range(4):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual(len(D0.requests), 2, "an ejected decode received requests")

    def test_decode_closing_before_headers_ejects(self):
        P = self.mock(prefill_handler(), name="P")
        D0 = self.mock(lambda req: CloseBeforeHeaders(), name="D0")
        D1 = self.mock(decode_handler(), name="D1")
        px = self.start([P], [D0, D1], self.flags(2))
        for i in range(6):
            r = self.post(px)
            if r.status != 200:
                self.assertErrorJson(r, 502)
            if self.up(px, "decode", D0) == 0:
                break
        self.assertEqual(self.up(px, "decode", D0), 0)
        self.assertEqual(len(D0.requests), 2)

    def test_4xx_never_eject(self):
        P = self.mock(lambda req: Respond(400, [("Content-Type", "application/json")],
                                          b'{"error":{"message":"bad prompt"}}'), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], self.flags(2))
        for i in range(25):
            r = self.post(px)
            self.assertEqual(r.status, 400, "request %d: P's 4xx passed through: %r" % (i, r))
        self.assertEqual(len(P.requests), 25, "every request reached the only prefill")
        self.assertEqual(self.up(px, "prefill", P), 1, "4xx ejected a prefill")
        self.assertEqual(self.outcome(px, "prefill", P, "client_error"), 25)
        self.assertEqual(D.requests, [])

    def test_decode_4xx_never_eject(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(status=422), name="D")
        px = self.start([P], [D], self.flags(2))
        for i in range(15):
            self.assertEqual(self.post(px).status, 422)
        self.assertEqual(len(D.requests), 15)
        self.assertEqual(self.up(px, "decode", D), 1, "4xx ejected a decode")
        self.assertEqual(http_request(px.port, "GET", "/ready").status, 200)

    def test_4xx_between_failures_resets_the_count(self):
        """Failures must be consecutive: a 4xx in between is a sign of life."""
        seq = iter([503, 400, 503, 400, 503, 400, 503, 400])
        P = self.mock(lambda req: Respond(next(seq), [("Content-Type", "application/json")],
                                          b'{"error":{"message":"x"}}'), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--unhealthy-after", "2", "--prefill-retries", "0"])
        for i in range(8):
            self.post(px)
        self.assertEqual(len(P.requests), 8)
        self.assertEqual(self.up(px, "prefill", P), 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
