#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""pdproxy's HTTP/1.1 front end on awkward but legal input (requests split
across reads, chunk extensions and trailers, absolute-form targets) and on
malformed input (conflicting lengths, bad chunk sizes, huge heads): legal
requests work, malformed ones get a 4xx and never reach P, and pdproxy
keeps serving."""

import json
import time

from pdharness.case import PxTestCase, main
from pdharness.client import RawClient, http_request
from pdharness.mocks import completion_body, decode_handler, prefill_handler
from pdharness.net import read_by_peer, wait_until

BODY = json.dumps(completion_body(prompt="split")).encode()


class HttpFrontTest(PxTestCase):
    def setUp(self):
        super().setUp()
        self.P = self.mock(prefill_handler(), name="P")
        self.D = self.mock(decode_handler(), name="D")
        self.px = self.start_proxy([self.P], [self.D])

    def _raw(self, data, pieces=None, gap=0.0, timeout=5.0):
        """Send `data` (in `pieces` parts `gap` s apart) and read one response."""
        c = RawClient(self.px.port)
        self.addCleanup(c.close)
        if pieces:
            step = max(1, -(-len(data) // pieces))
            for i in range(0, len(data), step):
                c.send(data[i:i + step])
                if gap:
                    time.sleep(gap)  # a client dribbling its request: the scenario
        else:
            c.send(data)
        return c.read_response(timeout=timeout)

    def _still_serves(self):
        self.assertTrue(self.px.alive())
        r = http_request(self.px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)

    def _assert_ok(self, r):
        self.assertEqual(r.status, 200, r)
        self.assertTrue(r.complete, r)
        self.assertEqual(self.P.requests[-1].json()["prompt"], "split")

    def test_request_byte_by_byte(self):
        data = RawClient.build("POST", "/v1/completions", BODY)
        self._assert_ok(self._raw(data, pieces=len(data), gap=0.001))

    def test_head_and_body_apart(self):
        data = RawClient.build("POST", "/v1/completions", BODY)
        head_len = data.index(b"\r\n\r\n") + 4
        c = RawClient(self.px.port)
        self.addCleanup(c.close)
        cport = c.sock.getsockname()[1]

        def read_by_pdproxy(what):
            # Each piece is read by pdproxy before the next is sent, so its
            # parser really sees the head's end and the body split.
            self.assertTrue(wait_until(lambda: read_by_peer(cport, self.px.port), 5.0),
                            "pdproxy did not read %s" % what)
        c.send(data[:head_len - 2])
        read_by_pdproxy("the head without its last CRLF")
        c.send(data[head_len - 2:head_len + 5])
        read_by_pdproxy("the head's end and the body's start")
        c.send(data[head_len + 5:])
        self._assert_ok(c.read_response(timeout=5))

    def test_chunked_with_extensions_and_trailers(self):
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        a, b = BODY[:10], BODY[10:]
        body = (b"%x;name=value\r\n" % len(a) + a + b"\r\n" + b"%X\r\n" % len(b) + b + b"\r\n"
                b"0\r\nX-Trailer: t\r\n\r\n")
        self._assert_ok(self._raw(head + body, pieces=7, gap=0.01))

    def test_absolute_form_target(self):
        # RFC 9112 §3.2.2: a server MUST accept the absolute-form.
        data = RawClient.build("POST", "http://127.0.0.1:%d/v1/completions" % self.px.port, BODY)
        self._assert_ok(self._raw(data))

    def test_conflicting_content_length_rejected(self):
        data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(BODY), len(BODY) + 1)
                + BODY + b"}")
        r = self._raw(data)
        self.assertEqual(r.status, 400, r)
        self.assertEqual(self.P.requests, [])
        self._still_serves()

    def test_bad_chunk_size_rejected(self):
        data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + BODY + b"\r\n0\r\n\r\n")
        r = self._raw(data)
        self.assertEqual(r.status, 400, r)
        self.assertEqual(self.P.requests, [])
        self._still_serves()

    def test_negative_content_length_rejected(self):
        data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n" + BODY)
        r = self._raw(data)
        self.assertEqual(r.status, 400, r)
        self.assertEqual(self.P.requests, [])
        self._still_serves()

    def test_huge_head_rejected(self):
        data = RawClient.build("POST", "/v1/completions", BODY,
                               [("X-Big", "h" * 200_000)])
        c = RawClient(self.px.port)
        self.addCleanup(c.close)
        try:
            c.send(data)
        except OSError:
            pass  # pdproxy may answer and close before reading it all
        r = c.read_response(timeout=5)
        self.assertIn(r.status, (400, 413, 431, None), r)
        self.assertFalse(r.timed_out, "no answer and no close for a 200 kB head")
        self.assertEqual(self.P.requests, [])
        self._still_serves()

    def test_many_headers(self):
        # pdproxy caps a request at 100 header fields (base/http.h); 93 pass.
        hs = [("X-H%d" % i, "v%d" % i) for i in range(90)]
        r = self._raw(RawClient.build("POST", "/v1/completions", BODY, hs))
        self._assert_ok(r)

    def test_too_many_headers_rejected(self):
        hs = [("X-H%d" % i, "v") for i in range(2000)]
        c = RawClient(self.px.port)
        self.addCleanup(c.close)
        try:
            c.send(RawClient.build("POST", "/v1/completions", BODY, hs))
        except OSError:
            pass
        r = c.read_response(timeout=5)
        self.assertIn(r.status, (400, 431, None), r)
        self.assertFalse(r.timed_out)
        self.assertEqual(self.P.requests, [])
        self._still_serves()

    def test_garbage_request_line(self):
        r = self._raw(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n")
        self.assertIn(r.status, (400, None), r)
        self.assertFalse(r.timed_out)
        self.assertEqual(self.P.requests, [])
        self._still_serves()


if __name__ == "__main__":
    main()
