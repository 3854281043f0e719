#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 5 item 7, graceful drain: on SIGTERM /ready turns 503 at once, new
connections are still taken during --drain-delay and refused after it,
streams in flight finish (up to --drain-timeout), then pdproxy exits 0.
SIGINT stops at once, also with status 0."""

import signal
import subprocess
import threading
import time
import unittest

from pdharness.client import RawClient, http_request
from pdharness.mocks import Stream, completion_body, decode_handler, prefill_handler, sse_events
from pdharness.net import connect_refused, now, wait_until
from pdharness.prod import ProdCase

N_EVENTS = 10
GAP = 0.2  # the long stream lasts about 2 s


def d_handler(events, gap):
    fast = decode_handler()

    def h(req):
        if (req.header("x-request-id") or "").startswith("long"):
            return Stream(200, [("Content-Type", "text/event-stream")],
                          [(0 if i == 0 else gap, e) for i, e in enumerate(events)])
        return fast(req)

    return h


class StreamReader:
    """Reads one streamed answer on a thread."""

    def __init__(self, port, rid, timeout=20):
        self.c = RawClient(port, timeout=timeout)
        self.c.request("POST", "/v1/completions", completion_body(stream=True),
                       [("X-Request-Id", rid)])
        self.resp = None
        self.progress = [0]
        self.t = threading.Thread(target=self._run, args=(timeout,), daemon=True)
        self.t.start()

    def _run(self, timeout):
        def prog(r):
            self.progress[0] = len(r.body)
        try:
            self.resp = self.c.read_response(timeout=timeout, on_progress=prog)
        finally:
            self.c.close()

    def join(self, timeout):
        self.t.join(timeout)
        return self.resp


class DrainTest(ProdCase):
    def setUp(self):
        super().setUp()
        self.events = sse_events(["tok%d " % i for i in range(N_EVENTS - 1)])
        self.P = self.mock(prefill_handler(), name="P")
        self.D = self.mock(d_handler(self.events, GAP), name="D")

    def wait_exit(self, px, timeout):
        try:
            return px.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def test_sigterm_mid_stream_completes_then_exit_0(self):
        delay = 1.0
        px = self.start([self.P], [self.D], ["--drain-delay", str(delay), "--drain-timeout", "10"],
                        drain_delay=None)
        self.assertEqual(http_request(px.port, "GET", "/ready").status, 200)
        s = StreamReader(px.port, "long-1")
        self.assertTrue(wait_until(lambda: s.progress[0] > 0, 5.0), "stream did not start")
        px.proc.send_signal(signal.SIGTERM)
        t_term = now()
        px._expected_exit = True

        # Readiness turns 503 at once (new connections are still accepted).
        def ready_status():
            return http_request(px.port, "GET", "/ready", timeout=2)

        r = wait_until(lambda: (lambda x: x if x.status == 503 else None)(ready_status()), 0.5)
        self.assertIsNotNone(r, "/ready not 503 within 0.5 s of SIGTERM")
        doc = r.json()
        self.assertIs(doc.get("draining"), True, doc)
        self.assertLess(now() - t_term, delay, "/ready checked during --drain-delay")
        self.assertEqual(http_request(px.port, "GET", "/health", timeout=2).status, 200,
                         "liveness stays 200 while draining")
        # A request arriving during the delay is still served.
        r2 = self.post(px, headers={"X-Request-Id": "during-delay"}, timeout=5)
        self.assertEqual(r2.status, 200, r2)
        self.assertLess(now() - t_term, delay, "too slow to test inside --drain-delay")

        # After the delay, new connections are refused.
        refused = wait_until(lambda: connect_refused(px.port), delay + 1.5, 0.02)
        t_refused = now() - t_term
        self.assertTrue(refused, "new connections still accepted %.1fs after SIGTERM "
                        "(--drain-delay %g)" % (t_refused, delay))
        self.assertGreaterEqual(t_refused, delay - 0.1,
                                "connections refused %.2fs after SIGTERM, before --drain-delay "
                                "(pdproxy exit status now: %r)" % (t_refused, px.proc.poll()))
        self.assertIsNone(px.proc.poll(), "pdproxy exited with a stream still in flight")

        resp = s.join(15)
        self.assertIsNotNone(resp)
        self.assertChunkedComplete(resp, "stream in flight across SIGTERM")
        self.assertEqual(bytes(resp.body), b"".join(self.events), "stream not intact")
        t_end = now()
        rc = self.wait_exit(px, 5.0)
        self.assertEqual(rc, 0, "exit status after drain (None: still running)")
        self.assertLess(now() - t_end, 2.0, "pdproxy lingered after its last stream ended")

    def test_sigterm_idle_exits_0_after_delay(self):
        px = self.start([self.P], [self.D], ["--drain-delay", "0.5"], drain_delay=None)
        # An idle keep-alive connection must not hold the drain up.
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body())
        self.assertEqual(c.read_response(timeout=5).status, 200)
        px._expected_exit = True
        t0 = now()
        px.proc.send_signal(signal.SIGTERM)
        rc = self.wait_exit(px, 5.0)
        took = now() - t0
        c.close()
        self.assertEqual(rc, 0)
        self.assertGreaterEqual(took, 0.45, "exited before --drain-delay 0.5")
        self.assertLess(took, 2.0, "idle pdproxy took %.2fs to drain" % took)

    def test_drain_timeout_cuts_what_is_left_and_exits_0(self):
        slow = self.mock(d_handler(self.events, 1.0), name="Dslow")  # 9 s stream
        px = self.start([self.P], [slow], ["--drain-delay", "0", "--drain-timeout", "1"],
                        drain_delay=None)
        s = StreamReader(px.port, "long-2")
        self.assertTrue(wait_until(lambda: s.progress[0] > 0, 5.0))
        px._expected_exit = True
        t0 = now()
        px.proc.send_signal(signal.SIGTERM)
        rc = self.wait_exit(px, 6.0)
        took = now() - t0
        self.assertEqual(rc, 0, "exit status after --drain-timeout (None: still running)")
        self.assertGreaterEqual(took, 0.9)
        self.assertLess(took, 3.0, "--drain-timeout 1 took %.2fs" % took)
        resp = s.join(5)
        self.assertIsNotNone(resp)
        self.assertFalse(resp.complete, "a stream cut by the drain timeout must not end cleanly")

    def test_sigint_exits_0_promptly(self):
        px = self.start([self.P], [self.D], ["--drain-delay", "5"], drain_delay=None)
        s = StreamReader(px.port, "long-3")
        self.assertTrue(wait_until(lambda: s.progress[0] > 0, 5.0))
        px._expected_exit = True
        t0 = now()
        px.proc.send_signal(signal.SIGINT)
        rc = self.wait_exit(px, 5.0)
        self.assertEqual(rc, 0)
        self.assertLess(now() - t0, 1.5, "SIGINT must not wait for --drain-delay")
        s.join(5)

    def test_second_sigterm_does_not_restart_the_delay(self):
        px = self.start([self.P], [self.D], ["--drain-delay", "0.8"], drain_delay=None)
        px._expected_exit = True
        t0 = now()
        px.proc.send_signal(signal.SIGTERM)
        # The second comes once pdproxy is draining (it said so), 0.5 s into
        # the 0.8 s delay: that point of the delay is the scenario.
        self.assertLogged(px, r'msg="SIGTERM: draining"')
        time.sleep(max(0.0, t0 + 0.5 - now()))
        px.proc.send_signal(signal.SIGTERM)
        rc = self.wait_exit(px, 5.0)
        self.assertEqual(rc, 0)
        self.assertLess(now() - t0, 2.5)


if __name__ == "__main__":
    unittest.main(verbosity=2)
