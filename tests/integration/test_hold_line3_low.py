#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 30, "hold the line, third round": the Low items, one class each.

L1. --reuse-port: a second instance with --reuse-port joined a first one
    that did not opt in (its workers always set SO_REUSEPORT).
L2. Sidecar mode: the allowlist covered hosts only (any port on an allowed
    host was reachable through x-prefiller-host-port).
L3. Sidecar mode: a prefill's 4xx body reached the client.
L4. --decode-idle-timeout acted as a time-to-head with a wrong "sent
    nothing" message."""

import json
import subprocess

from pdharness.case import main
from pdharness.client import RawClient, errmsg
from pdharness.ctl import url
from pdharness.mocks import Hang, Respond, Stream, decode_handler, prefill_handler
from pdharness.net import HOST, listening_inodes, socket_inodes, wait_until
from pdharness.procs import PDPROXY, Proxy, run_pdproxy
from pdharness.prod import ProdCase


class ReusePortJoinTest(ProdCase):
    """L1: only processes that all asked for --reuse-port share a port."""

    def test_opted_in_second_cannot_join_a_first_that_did_not(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], threads=2)
        p = subprocess.run([PDPROXY, "--host", HOST, "--port", str(px.port), "--threads", "2",
                            "--reuse-port"] + self.proxy_args([P], [D]),
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=10,
                           env=Proxy.clean_env())
        self.assertEqual(p.returncode, 2, p.stderr.decode()[-2000:])
        self.assertIn("in use", p.stderr.decode().lower())
        self.assertTrue(px.owns_port(), "the first instance lost its port")
        # The first instance's workers all serve: requests keep working.
        for _ in range(4):
            self.assertEqual(self.post(px).status, 200)

    def test_both_opted_in_share(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--reuse-port"])
        second = self.track_proxy(Proxy(["--host", HOST, "--port", str(px.port), "--reuse-port"]
                                        + self.proxy_args([P], [D]), port=px.port).spawn())
        listens = wait_until(lambda: not second.alive() or bool(
            listening_inodes(px.port) & socket_inodes(second.proc.pid)), 5.0, 0.02)
        self.assertTrue(second.alive() and listens, second.stderr())


class SidecarAllowPortTest(ProdCase):
    """L2: the allowlist names host:port; a host alone is refused, * says
    every port explicitly."""

    def sidecar(self, allow):
        self.D = self.mock(decode_handler(), name="D")
        return self.start(args=["--decode", url(self.D), "--prefiller-from-header",
                                "--prefiller-allowlist", allow])

    def test_other_port_on_an_allowed_host_refused(self):
        P = self.mock(prefill_handler(), name="P")
        Q = self.mock(prefill_handler(), name="Q")  # same host, another port
        px = self.sidecar("127.0.0.1:%d" % P.port)
        r = self.post(px, headers={"x-prefiller-host-port": "127.0.0.1:%d" % Q.port})
        self.assertEqual(r.status, 400, r.body)
        self.assertIn("not an allowed prefill target", errmsg(r))
        self.assertEqual((len(Q.requests), len(self.D.requests)), (0, 0))
        r = self.post(px, headers={"x-prefiller-host-port": "127.0.0.1:%d" % P.port})
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(P.requests), 1)

    def test_port_ranges_and_star(self):
        P = self.mock(prefill_handler(), name="P")
        px = self.sidecar("10.0.0.0/8:8000, 127.0.0.0/8:%d-%d" % (P.port, P.port + 1))
        self.assertEqual(self.post(px, headers={
            "x-prefiller-host-port": "127.0.0.1:%d" % P.port}).status, 200)
        self.assertEqual(self.post(px, headers={
            "x-prefiller-host-port": "127.0.0.1:%d" % (P.port + 2)}).status, 400)
        px2 = self.sidecar("127.0.0.1:*")
        self.assertEqual(self.post(px2, headers={
            "x-prefiller-host-port": "127.0.0.1:%d" % P.port}).status, 200)

    def test_entry_without_port_refused_at_start(self):
        for bad in ("127.0.0.1", "10.0.0.0/8", "prefill.example", "fd00::/8", "h:0", "h:9-8",
                    "h:x", "[fd00::1]", ":8000"):
            p = run_pdproxy(["--prefiller-from-header", "--prefiller-allowlist", bad,
                             "--print-config"])
            self.assertEqual(p.returncode, 2, bad)
            self.assertIn("not HOST:PORT", p.stderr, bad)
            self.assertIn("* for every port", p.stderr, bad)


class SidecarPrefill4xxTest(ProdCase):
    """L3: a header-named prefill's 4xx body reached the client as it was.
    Now its status does, in pdproxy's own OpenAI error, with the engine's
    message only when it answered a JSON error object (a configured
    prefill's 4xx is still relayed as it is: the operator's engine)."""

    def sidecar(self, status, body, ctype="application/json"):
        self.P = self.mock(lambda req: Respond(status, [("Content-Type", ctype)], body),
                           name="P")
        self.D = self.mock(decode_handler(), name="D")
        px = self.start(args=["--decode", url(self.D), "--prefiller-from-header",
                              "--prefiller-allowlist", "127.0.0.1:%d" % self.P.port])
        return px, {"x-prefiller-host-port": "127.0.0.1:%d" % self.P.port}

    def test_arbitrary_body_not_relayed(self):
        px, h = self.sidecar(403, b"<html>admin console, token s3cret-t0ken</html>", "text/html")
        r = self.post(px, headers=h)
        self.assertErrorJson(r, 403)
        self.assertNotIn(b"s3cret", bytes(r.body))
        self.assertEqual(errmsg(r), "prefill 127.0.0.1:%d answered HTTP 403" % self.P.port)
        self.assertEqual(len(self.D.requests), 0)

    def test_engine_error_message_kept(self):
        for body in (b'{"error":{"message":"This model\'s maximum context length is 16 tokens.",'
                     b'"type":"BadRequestError","param":null,"code":400},"extra":"x"}',
                     b'{"object":"error","message":"This model\'s maximum context length is '
                     b'16 tokens.","type":"BadRequestError","param":null,"code":400}'):
            with self.subTest(body=body):
                px, h = self.sidecar(400, body)
                r = self.post(px, headers=h)
                self.assertErrorJson(r, 400)
                self.assertEqual(errmsg(r), "prefill 127.0.0.1:%d answered HTTP 400: This "
                                 "model's maximum context length is 16 tokens." % self.P.port)
                self.assertNotIn(b'"extra"', bytes(r.body))

    def test_long_or_odd_messages_are_bounded(self):
        px, h = self.sidecar(422, json.dumps({"error": {"message": "\u00e9" * 400}}).encode())
        r = self.post(px, headers=h)
        self.assertErrorJson(r, 422)
        self.assertLess(len(errmsg(r)), 400)
        self.assertTrue(errmsg(r).endswith("\u00e9"))  # cut between characters
        px2, h2 = self.sidecar(400, b'{"error":"just a string"}')
        self.assertEqual(errmsg(self.post(px2, headers=h2)),
                         "prefill 127.0.0.1:%d answered HTTP 400" % self.P.port)

    def test_configured_prefill_4xx_still_relayed(self):
        body = b'{"error":{"message":"prompt too long","code":400}}'
        P = self.mock(lambda req: Respond(400, [("Content-Type", "application/json")], body),
                      name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D])
        r = self.post(px)
        self.assertEqual((r.status, bytes(r.body)), (400, body))


class DecodeIdleWordingTest(ProdCase):
    """L4: --decode-idle-timeout is documented as the time decode may go
    without sending a byte: before its response head (from the request) and
    between body bytes alike. Its message said "sent nothing" even when
    decode had streamed part of the answer; now it says which happened."""

    STREAM = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}

    def test_no_head_within_the_limit(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(lambda req: Hang(8.0), name="D")
        px = self.start([P], [D], ["--decode-idle-timeout", "1"])
        r = self.post(px)
        self.assertErrorJson(r, 504)
        self.assertEqual(errmsg(r), "decode 127.0.0.1:%d sent no response head within 1s of "
                         "the request (--decode-idle-timeout)" % D.port)

    def test_idle_mid_stream(self):
        P = self.mock(prefill_handler(), name="P")
        first = b'data: {"choices":[{"text":"a"}]}\n\n'
        D = self.mock(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         [(0, first), (8.0, b"data: [DONE]\n\n")]), name="D")
        px = self.start([P], [D], ["--decode-idle-timeout", "1"])
        c = RawClient(px.port)
        self.addCleanup(c.close)
        c.request("POST", "/v1/completions", self.STREAM)
        r = c.read_response(timeout=10)
        self.assertEqual(r.status, 200)
        self.assertEqual(bytes(r.body), first)  # the stream is cut after what came
        want = ("decode 127.0.0.1:%d went idle mid-answer: no byte for 1s after %d bytes "
                "(--decode-idle-timeout)" % (D.port, len(first)))
        self.assertTrue(wait_until(lambda: want in px.stderr(), 5.0), px.stderr()[-2000:])
        self.assertNotIn("sent nothing", px.stderr())

    def test_slow_but_steady_stream_is_not_idle(self):
        # Six pieces 0.4 s apart: 2 s in all, never 1 s without a byte.
        P = self.mock(prefill_handler(), name="P")
        pieces = [(0.4, b'data: {"choices":[{"text":"%d"}]}\n\n' % i) for i in range(5)]
        D = self.mock(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         pieces + [(0.4, b"data: [DONE]\n\n")]), name="D")
        px = self.start([P], [D], ["--decode-idle-timeout", "1"])
        c = RawClient(px.port)
        self.addCleanup(c.close)
        c.request("POST", "/v1/completions", self.STREAM)
        r = c.read_response(timeout=10)
        self.assertEqual(r.status, 200)
        self.assertTrue(bytes(r.body).endswith(b"data: [DONE]\n\n"), r.body)


if __name__ == "__main__":
    main()
