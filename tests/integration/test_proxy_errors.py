#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Errors: OpenAI-style JSON for client mistakes (400/404/405/413), P's 4xx
passed through, upstream failures (502/504), D failing mid-stream."""

import re
import threading
import time

from pdharness.case import PxTestCase, main
from pdharness.client import RawClient, http_request, raw_exchange
from pdharness.mocks import (CloseBeforeHeaders, Reset, Respond, Stream, completion_body,
                             decode_handler, prefill_handler, sse_events)
from pdharness.net import closed_port, wait_until

FAIL_RE = re.compile(r"(?i)fail|error|abort|reset|closed")


class ClientErrorTest(PxTestCase):
    def setUp(self):
        super().setUp()
        self.P = self.mock(prefill_handler(), name="P")
        self.D = self.mock(decode_handler(), name="D")

    def test_body_not_json_400(self):
        px = self.start_proxy([self.P], [self.D])
        for body in (b"not json", b"{", b'{"a":1} trailing', b"", b"\xff\xfe{}",
                     b'{"prompt":"x",}'):
            with self.subTest(body=body):
                r = http_request(px.port, "POST", "/v1/completions", body)
                self.assertErrorJson(r, 400)
        self.assertEqual(self.P.requests, [])
        self.assertEqual(self.D.requests, [])

    def test_json_not_object_400(self):
        px = self.start_proxy([self.P], [self.D])
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body in (b"[1,2]", b'"prompt"', b"42", b"null", b"true"):
                with self.subTest(path=path, body=body):
                    r = http_request(px.port, "POST", path, body)
                    self.assertErrorJson(r, 400)
        self.assertEqual(self.P.requests, [])

    def test_unknown_path_404(self):
        px = self.start_proxy([self.P], [self.D])
        # (Paths under /v1/ other than the P/D ones are the engine's: passed
        # to decode, test_pd_endpoints.py.)
        for method, path in (("POST", "/v1"), ("GET", "/nope"), ("POST", "/v2/completions"),
                             ("POST", "/completions")):
            with self.subTest(method=method, path=path):
                r = http_request(px.port, method, path, b"{}" if method == "POST" else None)
                self.assertErrorJson(r, 404)
        self.assertEqual(self.P.requests, [])

    def test_wrong_method_405(self):
        px = self.start_proxy([self.P], [self.D])
        for method, path in (("GET", "/v1/completions"), ("GET", "/v1/chat/completions"),
                             ("PUT", "/v1/completions"), ("DELETE", "/v1/chat/completions"),
                             ("POST", "/healthcheck")):
            with self.subTest(method=method, path=path):
                body = b"{}" if method in ("PUT", "POST") else None
                r = http_request(px.port, method, path, body)
                self.assertErrorJson(r, 405)
        self.assertEqual(self.P.requests, [])

    def test_body_over_limit_413(self):
        px = self.start_proxy([self.P], [self.D], extra=["--max-body-bytes", "1000"])
        base = b'{"model":"m","prompt":"'
        tail = b'"}'

        def body_of(n):
            return base + b"a" * (n - len(base) - len(tail)) + tail

        r = http_request(px.port, "POST", "/v1/completions", body_of(1000))
        self.assertEqual(r.status, 200, "a body of exactly the limit is accepted: %r" % r.body)
        r = http_request(px.port, "POST", "/v1/completions", body_of(1001))
        self.assertErrorJson(r, 413)
        r = raw_exchange(px.port, "POST", "/v1/completions", body_of(5000), chunked=True)
        self.assertErrorJson(r, 413, "chunked request")
        self.assertEqual(len(self.P.requests), 1)
        self.assertEqual(len(self.D.requests), 1)


class DefaultBodyLimitTest(PxTestCase):

    def test_default_limit_32mib(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([P], [D])
        limit = 32 * 1024 * 1024
        body = b'{"prompt":"' + b"z" * (limit + 1 - 13) + b'"}'
        self.assertEqual(len(body), limit + 1)
        c = RawClient(px.port, timeout=20)
        self.addCleanup(c.close)
        c.send(RawClient.build("POST", "/v1/completions", None,
                               [("Content-Type", "application/json"),
                                ("Content-Length", str(len(body)))]))

        def send_body():  # pdproxy may answer and close before reading it all
            try:
                c.sock.sendall(body)
            except OSError:
                pass

        t = threading.Thread(target=send_body, daemon=True)
        t.start()
        r = c.read_response(timeout=20)
        t.join(timeout=20)
        self.assertErrorJson(r, 413)
        self.assertEqual(P.requests, [])


class PrefillErrorTest(PxTestCase):
    def setUp(self):
        super().setUp()
        self.P = self.mock(prefill_handler(), name="P")
        self.D = self.mock(decode_handler(), name="D")

    def test_p_4xx_passed_through(self):
        px = self.start_proxy([self.P], [self.D])
        for status in (400, 401, 404, 422, 429):
            body = ('{"object":"error","message":"p says no %d","type":"BadRequestError",'
                    '"param":null,"code":%d}\n' % (status, status)).encode()
            self.P.set_handler(lambda req, s=status, b=body: Respond(
                s, [("Content-Type", "application/json")], b))
            with self.subTest(status=status):
                r = raw_exchange(px.port, "POST", "/v1/completions", completion_body())
                self.assertEqual(r.status, status)
                self.assertTrue(r.complete, r)
                self.assertEqual(bytes(r.body), body)
                self.assertEqual(r.header("content-type"), "application/json")
                self.assertEqual(r.header_all("x-request-id"),
                                 [self.P.requests[-1].header("x-request-id")])
        self.assertEqual(self.D.requests, [])

    def _expect_502(self, handler=None, p_port=None, n=1):
        if handler is not None:
            self.P.set_handler(handler)
        px = self.start_proxy([p_port or self.P], [self.D])
        for i in range(n):
            r = http_request(px.port, "POST", "/v1/completions", completion_body())
            if i == 0:
                self.assertErrorJson(r, 502)
            else:
                # Once failing, the only P may be ejected (passive health
                # checks): then "no healthy prefill" is a 503.
                self.assertIn(r.status, (502, 503), r.body)
                self.assertErrorJson(r, r.status)
        self.assertEqual(self.D.requests, [])
        return px

    def test_error_carries_request_id_and_is_logged(self):
        self.P.set_handler(lambda req: Respond(500, [("Content-Type", "text/plain")], b"boom"))
        px = self.start_proxy([self.P], [self.D])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         {"X-Request-Id": "err-id-4242"})
        self.assertErrorJson(r, 502)
        self.assertEqual(self.P.requests[0].header("x-request-id"), "err-id-4242")
        self.assertEqual(r.header("x-request-id"), "err-id-4242")
        lines = wait_until(
            lambda: [l for l in px.stderr().splitlines() if "err-id-4242" in l], 2.0)
        self.assertTrue(lines, "error not logged with the request id:\n" + px.stderr())

    def test_p_5xx_502(self):
        for status in (500, 503):
            with self.subTest(status=status):
                self._expect_502(lambda req, s=status: Respond(
                    s, [("Content-Type", "text/plain")], b"internal boom"))

    def test_p_refused_502(self):
        # P is up when pdproxy starts (so an active health check at startup
        # finds it healthy), then goes away: its port refuses connections.
        px = self.start_proxy([self.P], [self.D])
        self.P.wait_probes(1, timeout=0.5)
        self.P.stop()
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertErrorJson(r, 502)
        self.assertEqual(self.D.requests, [])

    def test_p_refused_from_start(self):
        # Never up: 502 (connect refused), or 503 if a startup health check
        # has already ejected it.
        px = self.start_proxy([closed_port()], [self.D])
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertIn(r.status, (502, 503), r.body)
        self.assertErrorJson(r, r.status)
        self.assertEqual(self.D.requests, [])

    def test_p_reset_502(self):
        self._expect_502(lambda req: Reset(), n=2)

    def test_p_close_before_headers_502(self):
        self._expect_502(lambda req: CloseBeforeHeaders(), n=2)

    def test_p_connect_timeout_504(self):
        bh = self.blackhole()
        if not bh.works:
            self.skipTest("cannot make a blackhole listener on this host")
        px = self.start_proxy([bh.port], [self.D], extra=["--connect-timeout", "0.3"])
        t0 = time.monotonic()
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        dt = time.monotonic() - t0
        self.assertErrorJson(r, 504)
        self.assertGreaterEqual(dt, 0.25, "answered before the connect timeout")
        self.assertLess(dt, 2.5, "connect timeout 0.3 s took %.2fs" % dt)
        self.assertEqual(self.D.requests, [])


class SlowUpstreamTest(PxTestCase):

    def test_connect_timeout_is_not_a_request_timeout(self):
        # --connect-timeout bounds connect() only: a P that thinks for 0.6 s
        # and a D that streams for 0.8 s are fine.
        events = sse_events(["slow%d" % i for i in range(3)])
        P = self.mock(lambda req: Respond(200, [("Content-Type", "application/json")],
                                          prefill_handler()(req).body, delay=0.6), name="P")
        D = self.mock(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         [(0.2, e) for e in events]), name="D")
        px = self.start_proxy([P], [D], extra=["--connect-timeout", "0.3"])
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(stream=True))
        self.assertEqual(r.status, 200, r.body)
        self.assertChunkedComplete(r)
        self.assertEqual(bytes(r.body), b"".join(events))


class DecodeErrorTest(PxTestCase):
    def setUp(self):
        super().setUp()
        self.P = self.mock(prefill_handler(), name="P")
        self.D = self.mock(decode_handler(), name="D")

    def _expect(self, status, handler=None, d_port=None, n=2):
        if handler is not None:
            self.D.set_handler(handler)
        px = self.start_proxy([self.P], [d_port or self.D])
        for i in range(n):
            r = http_request(px.port, "POST", "/v1/completions", completion_body())
            if i == 0:
                self.assertErrorJson(r, status)
                self.assertEqual(len(self.P.requests), 1)
            else:  # the only D may be ejected by now: 503
                self.assertIn(r.status, (status, 503), r.body)
                self.assertErrorJson(r, r.status)
        return px

    def test_d_refused_502(self):
        px = self.start_proxy([self.P], [self.D])
        self.D.wait_probes(1, timeout=0.5)
        self.D.stop()
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertErrorJson(r, 502)
        self.assertEqual(len(self.P.requests), 1)

    def test_d_refused_from_start(self):
        px = self.start_proxy([self.P], [closed_port()])
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertIn(r.status, (502, 503), r.body)
        self.assertErrorJson(r, r.status)

    def test_d_reset_before_headers_502(self):
        self._expect(502, lambda req: Reset())

    def test_d_close_before_headers_502(self):
        self._expect(502, lambda req: CloseBeforeHeaders())

    def test_d_connect_timeout_504(self):
        bh = self.blackhole()
        if not bh.works:
            self.skipTest("cannot make a blackhole listener on this host")
        px = self.start_proxy([self.P], [bh.port], extra=["--connect-timeout", "0.3"])
        t0 = time.monotonic()
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        dt = time.monotonic() - t0
        self.assertErrorJson(r, 504)
        self.assertGreaterEqual(dt, 0.25)
        self.assertLess(dt, 2.5, "connect timeout 0.3 s took %.2fs" % dt)

    def _mid_stream(self, end, framing):
        events = sse_events(["a", "b", "c"], done=False)
        self.D.set_handler(lambda req: Stream(
            200, [("Content-Type", "text/event-stream")], [(0.02, e) for e in events],
            framing=framing, end=end,
            length=sum(len(e) for e in events) + 1000 if framing == "length" else None))
        px = self.start_proxy([self.P], [self.D])
        c = RawClient(px.port)
        self.addCleanup(c.close)
        c.request("POST", "/v1/completions", completion_body(stream=True))
        r = c.read_response(timeout=5.0)
        self.assertFalse(r.timed_out, "proxy neither finished nor closed the stream: %r" % r)
        self.assertEqual(r.status, 200)
        self.assertEqual(r.framing, "chunked")
        self.assertFalse(r.complete, "stream ended with a 0-chunk though D failed: %r" % r)
        self.assertTrue(r.eof, "connection must be closed after a failed stream")
        self.assertEqual(bytes(r.body), b"".join(events), "bytes before the failure must arrive")
        rid = self.D.requests[0].header("x-request-id")
        lines = wait_until(lambda: [l for l in px.stderr().splitlines()
                                    if rid in l and FAIL_RE.search(l)], 2.0)
        self.assertTrue(lines, "failure not logged with req id %s:\n%s" % (rid, px.stderr()))
        return px

    def test_d_close_mid_stream_chunked(self):
        self._mid_stream("close", "chunked")

    def test_d_reset_mid_stream(self):
        self._mid_stream("reset", "chunked")

    def test_d_close_mid_stream_content_length(self):
        self._mid_stream("close", "length")


if __name__ == "__main__":
    main()
