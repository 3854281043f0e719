#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 5 item 6, limits: --max-inflight (503 + Retry-After beyond it),
--prefill-timeout (504), --decode-idle-timeout (no byte from D for that long
fails the request or cuts the stream), --client-header-timeout (408 for a
client that sends its request too slowly)."""

import socket
import threading
import time
import unittest

from pdharness.client import RawClient, http_request, strict_json
from pdharness.mocks import (Hang, Respond, Stream, completion_body, decode_handler,
                             prefill_handler, sse_events)
from pdharness.net import HOST, MAX_LOOP, now
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom


class MaxInflightTest(ProdCase):
    def test_beyond_max_inflight_503_with_retry_after(self):
        P = self.mock(prefill_handler(delay=1.5), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--max-inflight", "2"])
        held = []
        ts = [threading.Thread(target=lambda: held.append(self.post(px, timeout=10).status),
                               daemon=True) for _ in range(2)]
        for t in ts:
            t.start()
        self.assertEqual(len(P.wait_requests(2, 5.0)), 2)
        self.assertEqual(metric(prom(px.port), "pdproxy_inflight_requests"), 2)
        for i in range(8):
            r = self.post(px, headers={"X-Request-Id": "over-%d" % i})
            self.assertErrorJson(r, 503, "request %d beyond --max-inflight 2" % i)
            ra = r.header("retry-after")
            self.assertIsNotNone(ra, "503 without Retry-After: %r" % r.headers)
            self.assertTrue(ra.strip().isdigit() and int(ra) >= 1, "Retry-After %r" % ra)
        for path in ("/health", "/ready", "/healthcheck", "/metrics"):
            self.assertEqual(http_request(px.port, "GET", path).status, 200,
                             "%s while saturated" % path)
        self.assertEqual(len(P.requests), 2, "a rejected request reached prefill")
        for t in ts:
            t.join(10)
        self.assertEqual(held, [200, 200])
        # Rejected requests gave their slots back: two at once fit again.
        res = self.concurrent(lambda i: self.post(px).status, 2, timeout=10)
        self.assertEqual(res, [200, 200])
        self.assertEqual(metric(prom(px.port), "pdproxy_inflight_requests"), 0)

    def test_max_inflight_counts_streams_until_they_end(self):
        P = self.mock(prefill_handler(), name="P")
        ev = sse_events(["a", "b", "c"])
        D = self.mock(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         [(0.0, ev[0]), (1.0, ev[1]), (0.0, ev[2]),
                                          (0.0, ev[3])]), name="D")
        px = self.start([P], [D], ["--max-inflight", "1"])
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body(stream=True))
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("r", c.read_response(timeout=10)),
                             daemon=True)
        t.start()
        self.assertEqual(len(D.wait_requests(1, 5.0)), 1)
        r = self.post(px)
        self.assertErrorJson(r, 503, "a second request while one stream is open")
        t.join(10)
        c.close()
        self.assertTrue(got["r"].complete)
        self.assertEqual(self.post(px).status, 200)


class PrefillTimeoutTest(ProdCase):
    def test_prefill_timeout_504(self):
        P = self.mock(lambda req: Hang(10.0), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--prefill-timeout", "1"])
        t0 = now()
        r = self.post(px, timeout=10)
        took = now() - t0
        self.assertErrorJson(r, 504)
        self.assertGreaterEqual(took, 0.9, "504 before --prefill-timeout 1")
        self.assertLess(took, 2.5, "--prefill-timeout 1 took %.2fs" % took)
        self.assertEqual(D.requests, [])
        conn = P.requests[0].conn
        self.assertIsNotNone(conn.wait_closed(2.0), "pdproxy left the timed-out prefill open")

    def test_prefill_timeout_bounds_retries_in_all(self):
        """--prefill-timeout is what a prefill may take "in all" (--help):
        two 5xx answers after 0.7 s each, then a hang, end at 1 s, not 2.4 s."""
        Ps = [self.mock(lambda req: Respond(500, [], b"", delay=0.7), name="P0"),
              self.mock(lambda req: Respond(500, [], b"", delay=0.7), name="P1"),
              self.mock(lambda req: Hang(10.0), name="P2")]
        D = self.mock(decode_handler(), name="D")
        px = self.start(Ps, [D], ["--prefill-timeout", "1", "--prefill-retries", "2",
                                  "--unhealthy-after", "100"])
        t0 = now()
        r = self.post(px, timeout=10)
        took = now() - t0
        self.assertIn(r.status, (502, 504), r)
        self.assertLess(took, 1.8, "--prefill-timeout 1 with retries: the client waited %.2fs "
                        "(prefill attempts: %r)" % (took, [len(m.requests) for m in Ps]))

    def test_prefill_under_timeout_succeeds(self):
        P = self.mock(prefill_handler(delay=0.5), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--prefill-timeout", "2"])
        self.assertEqual(self.post(px).status, 200)


class DecodeIdleTimeoutTest(ProdCase):
    def test_stall_after_headers_cuts_stream(self):
        P = self.mock(prefill_handler(), name="P")
        ev = sse_events(["one", "two"])
        D = self.mock(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         [(0, ev[0]), (8.0, ev[1]), (0, ev[2])]), name="D")
        px = self.start([P], [D], ["--decode-idle-timeout", "1"])
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body(stream=True))
        r = c.read_response(timeout=8)
        c.close()
        self.assertEqual(r.status, 200)
        self.assertFalse(r.timed_out, "stream not cut within 8 s (--decode-idle-timeout 1)")
        self.assertFalse(r.complete, "a stream cut by the idle timeout must not end cleanly")
        self.assertEqual(bytes(r.body), ev[0])
        t_first = r.time_body_reached(len(ev[0]))
        stall = r.t_done - t_first if r.t_done else now() - t_first
        self.assertGreaterEqual(stall, 0.9)
        self.assertLess(stall, 3.0, "cut %.2fs after the last byte (--decode-idle-timeout 1)"
                        % stall)
        self.assertIsNotNone(D.requests[0].conn.wait_closed(2.0),
                             "pdproxy left the stalled decode open")

    def test_stall_before_headers_504(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(lambda req: Hang(10.0), name="D")
        px = self.start([P], [D], ["--decode-idle-timeout", "1"])
        t0 = now()
        r = self.post(px, timeout=10)
        took = now() - t0
        self.assertErrorJson(r, 504)
        self.assertLess(took, 3.0, took)
        self.assertGreaterEqual(took, 0.9, took)

    def test_slow_but_steady_stream_completes(self):
        P = self.mock(prefill_handler(), name="P")
        ev = sse_events(["t%d" % i for i in range(6)])
        D = self.mock(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         [(0.4, e) for e in ev]), name="D")
        px = self.start([P], [D], ["--decode-idle-timeout", "1"])
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body(stream=True))
        r = c.read_response(timeout=10)
        c.close()
        self.assertTrue(r.complete, "a stream with 0.4 s gaps was cut (--decode-idle-timeout 1): "
                        "%r" % r)
        self.assertEqual(bytes(r.body), b"".join(ev))


class ClientHeaderTimeoutTest(ProdCase):
    def slow_send(self, px, pieces, gap, limit):
        """Sends pieces `gap` s apart until pdproxy answers or `limit` s pass.
        Returns (seconds from the first byte to the answer, answer bytes)."""
        s = socket.create_connection((HOST, px.port), timeout=5)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(gap)
        t0 = now()
        data = b""
        i = 0
        try:
            for _ in range(MAX_LOOP):
                if now() - t0 > limit:
                    break
                if i < len(pieces):
                    try:
                        s.sendall(pieces[i])
                    except OSError:
                        pass
                    i += 1
                try:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                    if b"\r\n\r\n" in data:
                        # Read the whole (small) answer.
                        s.settimeout(1.0)
                        try:
                            for _ in range(100):
                                more = s.recv(65536)
                                if not more:
                                    break
                                data += more
                        except (socket.timeout, OSError):
                            pass
                        break
                except socket.timeout:
                    continue
                except OSError:
                    break
        finally:
            s.close()
        return now() - t0, data

    def check_408(self, data, took, what):
        self.assertTrue(data.startswith(b"HTTP/1.1 408"), "%s: got %r after %.2fs"
                        % (what, data[:200], took))
        body = data.split(b"\r\n\r\n", 1)[1]
        doc = strict_json(body)
        self.assertEqual(doc["error"]["code"], 408)
        self.assertGreaterEqual(took, 0.9, "%s: 408 after %.2fs, before the timeout" % (what, took))
        self.assertLess(took, 2.2, "%s: 408 only after %.2fs (--client-header-timeout 1)"
                        % (what, took))

    def test_slowloris_headers_408(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--client-header-timeout", "1"])
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 10) for i in range(40)))
        # One byte every 0.1 s: each gap far below the timeout, the whole
        # head far beyond it.
        pieces = [head[i:i + 1] for i in range(len(head))]
        took, data = self.slow_send(px, pieces, 0.1, 5.0)
        self.check_408(data, took, "slow head")
        self.assertEqual(P.requests, [])

    def test_slow_body_408(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--client-header-timeout", "1"])
        body = b'{"model":"m","prompt":"' + b"x" * 60 + b'"}'
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        pieces = [head] + [body[i:i + 2] for i in range(0, len(body), 2)]
        took, data = self.slow_send(px, pieces, 0.15, 5.0)
        self.check_408(data, took, "slow body")
        self.assertEqual(P.requests, [])

    def test_prompt_request_not_affected(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--client-header-timeout", "1"])
        c = RawClient(px.port)
        for i in range(3):
            c.request("POST", "/v1/completions", completion_body())
            self.assertEqual(c.read_response(timeout=5).status, 200)
            time.sleep(0.6)  # idle between requests on a keep-alive connection
        c.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
