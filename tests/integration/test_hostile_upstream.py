#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 7 item 3, upstream faults: a prefill or decode that accepts and never
answers (the timeouts fire, the client gets a 504 in OpenAI JSON); decode
closing or resetting in the middle of an SSE event; decode sending malformed
chunked encoding; prefill answering 200 with a non-JSON body or a 50 MiB one
(502, pdproxy's memory stays bounded); and a decode resetting connections at
random points under wrk load for 30 s (pdproxy survives, every response it
gave was a 2xx or a proper 502/503/504 error)."""

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

from pdharness.case import main
from pdharness.client import RawClient, http_request, strict_json
from pdharness.mocks import (CloseBeforeHeaders, Hang, Reset, Respond, Stream, completion_body,
                             decode_handler, default_p_kv, prefill_handler, sse_events)
from pdharness.net import HOST, MAX_LOOP, Listener, now, wait_until
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom

SSE = ("Content-Type", "text/event-stream")
JSONCT = ("Content-Type", "application/json")


class Silent(Listener):
    """A backend that accepts connections and never reads or writes a byte."""

    def __init__(self):
        super().__init__(backlog=64, name="silent")
        self.socks = []
        self.start_accepting()

    def accepted(self, sock):
        self.socks.append(sock)

    def all_closed_by_peer(self, timeout):
        """Drains every accepted connection: True when pdproxy closed each
        one (EOF or RST) within `timeout`."""
        deadline = now() + timeout
        for s in list(self.socks):
            for _ in range(MAX_LOOP):
                left = deadline - now()
                if left <= 0:
                    return False
                s.settimeout(min(left, 1.0))
                try:
                    if not s.recv(1 << 20):
                        break
                except socket.timeout:
                    continue
                except OSError:
                    break
        return True

    def close(self):
        self.stop_accepting()
        for s in self.socks:
            s.close()


def proc_status(pid):
    """{'VmRSS': kB, 'VmHWM': kB, ...} from /proc/<pid>/status."""
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            k, _, v = line.partition(":")
            if v.strip().endswith("kB"):
                out[k] = int(v.split()[0])
    return out


class UpstreamCase(ProdCase):
    def silent(self):
        s = Silent()
        self.addCleanup(s.close)
        return s

    def assertCutStream(self, r, sent, what):
        """A 200 stream that pdproxy cut: every byte decode sent arrived, no
        more, no terminating 0-chunk, and the connection closed."""
        self.assertFalse(r.timed_out, "%s: the stream was neither finished nor cut: %r" % (what, r))
        self.assertEqual(r.status, 200, what)
        self.assertEqual(r.framing, "chunked", "%s: %r" % (what, r.raw_head))
        self.assertFalse(r.complete, "%s: the stream ended cleanly though decode failed" % what)
        self.assertTrue(r.eof, "%s: connection left open after a cut stream" % what)
        self.assertEqual(bytes(r.body), sent, "%s: the client got other bytes than decode sent"
                         % what)


# --------------------------------------------------------------------------


class NeverAnswersTest(UpstreamCase):
    """Engines that accept and never answer: --prefill-timeout and
    --decode-idle-timeout fire, the client gets 504 JSON, the engine's
    connection is closed."""

    BIG = "x" * (8 * 1024 * 1024)  # more than loopback buffers take without a reader

    def timed_504(self, px, body, what, lo=0.9, hi=2.5, since=None):
        """POSTs `body`, expects 504 between lo and hi seconds after the
        request was sent, or after since() (when the timed part began)."""
        t0 = now()
        r = http_request(px.port, "POST", "/v1/completions", body, timeout=15)
        t1 = now()
        if since is not None:
            t0 = since()
        took = t1 - t0
        self.assertErrorJson(r, 504, what)
        self.assertGreaterEqual(took, lo, "%s: 504 after %.2fs, before the timeout" % (what, took))
        self.assertLess(took, hi, "%s: 504 only after %.2fs" % (what, took))
        return r

    def test_prefill_never_reads(self):
        P = self.silent()
        D = self.mock(decode_handler(), name="D")
        px = self.start([P.port], [D], ["--prefill-timeout", "1", "--prefill-retries", "0"])
        for what, body in (("small", completion_body()),
                           ("8 MiB, upload stalls", completion_body(prompt=self.BIG)),
                           ("stream", completion_body(stream=True))):
            with self.subTest(body=what):
                self.timed_504(px, body, "silent prefill, " + what)
        self.assertEqual(D.requests, [], "decode called without a prefill answer")
        self.assertTrue(P.all_closed_by_peer(5), "pdproxy left a timed-out prefill connection open")
        self.assertEqual(metric(prom(px.port), "pdproxy_inflight_requests"), 0)

    def test_prefill_reads_never_answers(self):
        P = self.mock(lambda req: Hang(15.0), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--prefill-timeout", "1", "--prefill-retries", "0"])
        self.timed_504(px, completion_body(stream=True), "hanging prefill, stream")
        self.assertEqual(D.requests, [])
        self.assertIsNotNone(P.requests[0].conn.wait_closed(2.0),
                             "pdproxy left the timed-out prefill open")

    def test_prefill_headers_then_nothing(self):
        """Headers of a 200, then silence: the prefill timeout covers the body."""
        P = self.mock(lambda req: Stream(200, [JSONCT], [(15.0, b"{}")], framing="length",
                                         length=2), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--prefill-timeout", "1", "--prefill-retries", "0"])
        self.timed_504(px, completion_body(), "prefill head then silence")
        self.assertEqual(D.requests, [])
        self.assertIsNotNone(P.requests[0].conn.wait_closed(2.0))

    def test_decode_never_reads(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.silent()
        px = self.start([P], [D.port], ["--decode-idle-timeout", "1", "--prefill-timeout", "10"])
        for what, body in (("small", completion_body()),
                           ("stream", completion_body(stream=True)),
                           ("8 MiB, upload stalls", completion_body(prompt=self.BIG))):
            with self.subTest(body=what):
                # The decode idle timeout runs from the end of prefill's answer.
                self.timed_504(px, body, "silent decode, " + what,
                               since=lambda: P.requests[-1].t_done)
        self.assertTrue(D.all_closed_by_peer(5), "pdproxy left a timed-out decode connection open")
        self.assertEqual(metric(prom(px.port), "pdproxy_inflight_requests"), 0)

    def test_decode_reads_never_answers(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(lambda req: Hang(15.0), name="D")
        px = self.start([P], [D], ["--decode-idle-timeout", "1"])
        self.timed_504(px, completion_body(stream=True), "hanging decode, stream")
        self.assertIsNotNone(D.requests[0].conn.wait_closed(2.0),
                             "pdproxy left the timed-out decode open")


# --------------------------------------------------------------------------


class MidEventTest(UpstreamCase):
    """Decode stops in the middle of an SSE event."""

    EV = sse_events(["alpha", "beta", "gamma"])
    HALF = EV[1][:len(EV[1]) // 2]

    def run_case(self, stream, extra=(), what=""):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(lambda req: stream, name="D")
        px = self.start([P], [D], list(extra))
        c = RawClient(px.port)
        self.addCleanup(c.close)
        c.request("POST", "/v1/completions", completion_body(stream=True))
        r = c.read_response(timeout=8)
        self.assertCutStream(r, self.EV[0] + self.HALF, what)
        self.assertIsNotNone(D.requests[0].conn.wait_closed(3.0), what)
        # pdproxy is fine afterwards and does not reuse the broken connection.
        D.set_handler(lambda req: Stream(200, [SSE], [(0, e) for e in self.EV]))
        c2 = RawClient(px.port)
        self.addCleanup(c2.close)
        c2.request("POST", "/v1/completions", completion_body(stream=True))
        r2 = c2.read_response(timeout=5)
        self.assertChunkedComplete(r2, what + ", next request")
        self.assertEqual(bytes(r2.body), b"".join(self.EV))
        self.assertNotEqual(D.requests[1].conn_id, D.requests[0].conn_id)
        return r

    def test_close_mid_event_chunked(self):
        self.run_case(Stream(200, [SSE], [(0, self.EV[0]), (0.05, self.HALF)], end="close"),
                      what="close mid-event, chunked")

    def test_reset_mid_event_chunked(self):
        self.run_case(Stream(200, [SSE], [(0, self.EV[0]), (0.05, self.HALF)], end="reset"),
                      what="reset mid-event, chunked")

    def test_close_mid_event_content_length(self):
        n = sum(len(e) for e in self.EV)
        self.run_case(Stream(200, [SSE], [(0, self.EV[0]), (0.05, self.HALF)], framing="length",
                             length=n, end="close"), what="close mid-event, Content-Length")

    def test_half_event_then_silence(self):
        """Half an event, then nothing: --decode-idle-timeout cuts it."""
        t0 = now()
        self.run_case(Stream(200, [SSE], [(0, self.EV[0]), (0.05, self.HALF), (15.0, b"x")]),
                      extra=["--decode-idle-timeout", "1"], what="half event then silence")
        self.assertLess(now() - t0, 6.0)

    def test_close_mid_chunk_header(self):
        """Decode's connection ends inside a chunk (its size said more)."""
        raw = b"%x\r\n" % len(self.EV[0]) + self.EV[0] + b"\r\n" + b"%x\r\n" % len(self.EV[1]) \
            + self.HALF

        self.run_case(Stream(200, [SSE, ("Transfer-Encoding", "chunked")], [(0, raw)],
                             framing="close", end="close"),
                      what="close inside a chunk")


# --------------------------------------------------------------------------


class MalformedChunkedTest(UpstreamCase):
    GOOD = b'{"id":"cmpl","object":"text_completion","choices":[{"text":"'

    SHAPES = [
        ("bad hex size first", b"zz\r\n" + GOOD + b"\r\n0\r\n\r\n", b""),
        ("bad hex size after a chunk",
         b"%x\r\n" % len(GOOD) + GOOD + b"\r\nq1\r\nmore\r\n0\r\n\r\n", GOOD),
        ("negative size", b"%x\r\n" % len(GOOD) + GOOD + b"\r\n-5\r\nmore!\r\n0\r\n\r\n", GOOD),
        ("size overflow", b"%x\r\n" % len(GOOD) + GOOD + b"\r\n" + b"f" * 40
         + b"\r\nmore\r\n0\r\n\r\n", GOOD),
        ("missing CRLF after data", b"%x\r\n" % len(GOOD) + GOOD + b"XX5\r\nmore!\r\n0\r\n\r\n",
         GOOD),
        ("data longer than size", b"5\r\n" + GOOD + b"\r\n0\r\n\r\n", GOOD[:5]),
    ]

    def one(self, px, D, name, raw, good, stream):
        D.set_handler(lambda req: Respond(
            200, [SSE if stream else JSONCT, ("Transfer-Encoding", "chunked")], raw,
            raw_framing=True))
        c = RawClient(px.port)
        self.addCleanup(c.close)
        t0 = now()
        c.request("POST", "/v1/completions", completion_body(stream=stream))
        r = c.read_response(timeout=8)
        took = now() - t0
        self.assertFalse(r.timed_out, "%s: no end: %r" % (name, r))
        # The idle timeout is 5 s: an answer well before it means pdproxy saw
        # the broken framing itself.
        self.assertLess(took, 3.0, "%s: %.2fs to notice the broken framing" % (name, took))
        if r.status == 502:
            self.assertErrorJson(r, 502, name)
        else:
            self.assertCutStream(r, good, name)
        self.assertNotIn(b"more", bytes(r.body), "%s: bytes past the malformation reached the "
                         "client" % name)

    def test_malformed_chunked_from_decode(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--decode-idle-timeout", "5", "--unhealthy-after", "1000"])
        for name, raw, good in self.SHAPES:
            for stream in (False, True):
                with self.subTest(shape=name, stream=stream):
                    self.one(px, D, name, raw, good, stream)
        D.set_handler(decode_handler())
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(metric(prom(px.port), "pdproxy_inflight_requests"), 0)

    def test_malformed_chunked_from_prefill_502(self):
        """Prefill's answer is read whole: broken framing there is a 502."""
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--prefill-timeout", "5", "--prefill-retries", "0",
                                   "--unhealthy-after", "1000"])
        doc = json.dumps({"choices": [{"text": "x"}],
                          "kv_transfer_params": default_p_kv()}).encode()
        for name, raw in (("bad hex", b"zz\r\n" + doc + b"\r\n0\r\n\r\n"),
                          ("missing CRLF", b"%x\r\n" % (len(doc) - 3) + doc + b"\r\n0\r\n\r\n"),
                          ("overflow", b"f" * 40 + b"\r\n" + doc + b"\r\n0\r\n\r\n")):
            with self.subTest(shape=name):
                P.set_handler(lambda req, raw=raw: Respond(
                    200, [JSONCT, ("Transfer-Encoding", "chunked")], raw, raw_framing=True))
                t0 = now()
                r = http_request(px.port, "POST", "/v1/completions", completion_body())
                self.assertErrorJson(r, 502, name)
                self.assertLess(now() - t0, 3.0, name)
        self.assertEqual(D.requests, [])


# --------------------------------------------------------------------------


class PrefillGarbageTest(UpstreamCase):
    def test_prefill_200_not_json_502(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--unhealthy-after", "1000"])
        bodies = [
            ("text", b"hello, world", "text/plain", "length"),
            ("html", b"<html><body><h1>200 OK</h1></body></html>", "text/html", "length"),
            ("empty", b"", "application/json", "length"),
            ("truncated JSON", b'{"choices":[{"text":"x"}],"kv_transfer_params":{"remote_host":',
             "application/json", "length"),
            ("JSON then garbage", b'{"choices":[]} <garbage>', "application/json", "chunked"),
            ("invalid UTF-8", b'{"choices":[{"text":"\xff\xfe"}]}', "application/json", "length"),
            ("binary", bytes(range(256)) * 4, "application/octet-stream", "close"),
            ("NaN", b'{"choices":[],"x":NaN}', "application/json", "length"),
        ]
        for name, body, ct, framing in bodies:
            with self.subTest(body=name):
                P.set_handler(lambda req, body=body, ct=ct, framing=framing: Respond(
                    200, [("Content-Type", ct)], body, framing=framing))
                for stream in (False, True):
                    r = http_request(px.port, "POST", "/v1/completions",
                                     completion_body(stream=stream))
                    self.assertErrorJson(r, 502, "%s, stream=%s" % (name, stream))
        self.assertEqual(D.requests, [], "decode called after a garbage prefill answer")
        P.set_handler(prefill_handler())
        self.assertEqual(http_request(px.port, "POST", "/v1/completions",
                                      completion_body()).status, 200)

    def test_prefill_50mib_answer_502_memory_bounded(self):
        pad = b"p" * (50 * 1024 * 1024)
        kv = json.dumps(default_p_kv()).encode()
        # Valid JSON: its size is the only thing wrong with it.
        huge = b'{"choices":[{"text":"x"}],"kv_transfer_params":' + kv + b',"pad":"' + pad + b'"}'
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        # Under AddressSanitizer, freed memory sits in a quarantine (256 MiB by
        # default) instead of being reused, so the peak RSS would sum every
        # buffer ever freed. Without the quarantine it measures what pdproxy
        # holds at once, as in a plain build. (No effect on a plain build.)
        asan = os.environ.get("ASAN_OPTIONS", "")
        env = {"ASAN_OPTIONS": (asan + ":" if asan else "") + "quarantine_size_mb=0"}
        px = self.start([P], [D], ["--unhealthy-after", "1000", "--prefill-retries", "0"], env=env)
        pid = px.proc.pid
        for i in range(3):  # warm up: threads, curl handles, buffers
            self.assertEqual(http_request(px.port, "POST", "/v1/completions",
                                          completion_body()).status, 200)
        base = proc_status(pid)
        peak_hwm = base["VmHWM"]
        for framing in ("length", "chunked", "close"):
            with self.subTest(framing=framing):
                P.set_handler(lambda req, framing=framing: Respond(200, [JSONCT], huge,
                                                                   framing=framing))
                n_d = len(D.requests)
                t0 = now()
                r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                                 timeout=30)
                self.assertErrorJson(r, 502, "50 MiB prefill answer, %s" % framing)
                self.assertLess(now() - t0, 10.0)
                self.assertEqual(len(D.requests), n_d, "decode called after a 50 MiB answer")
                st = proc_status(pid)
                peak_hwm = max(peak_hwm, st["VmHWM"])
                grew = (st["VmHWM"] - base["VmRSS"]) / 1024.0
                self.assertLess(grew, 20.0, "pdproxy's peak RSS grew %.1f MiB over %.1f MiB on a "
                                "50 MiB prefill answer (%s)" % (grew, base["VmRSS"] / 1024.0,
                                                                framing))
        P.set_handler(prefill_handler())
        self.assertEqual(http_request(px.port, "POST", "/v1/completions",
                                      completion_body()).status, 200)
        sys.stderr.write("\n[50MiB] RSS %.1f MiB before, peak %.1f MiB, now %.1f MiB\n"
                         % (base["VmRSS"] / 1024.0, peak_hwm / 1024.0,
                            proc_status(pid)["VmRSS"] / 1024.0))


class NoSilentResendTest(UpstreamCase):
    """README: "a decode is retried only when it was never reached: once
    decode may have read prefill's blocks, the request is not resent". That
    must hold on a reused (keep-alive) upstream connection too, where an
    HTTP client library may silently resend a request whose connection
    "died" before any answer byte. Likewise a prefill is retried only as
    --prefill-retries says (0: never)."""

    def check(self, role, failing, what):
        n = {"i": 0}
        normal = prefill_handler() if role == "prefill" else decode_handler()

        def h(req):
            n["i"] += 1
            return failing() if n["i"] == 2 else normal(req)
        if role == "prefill":
            P = M = self.mock(h, name="P")
            D = self.mock(decode_handler(), name="D")
        else:
            P = self.mock(prefill_handler(), name="P")
            D = M = self.mock(h, name="D")
        # One worker thread: one pool of upstream connections, so the second
        # request reuses the first one's connection.
        px = self.start([P], [D], ["--unhealthy-after", "1000", "--prefill-retries", "0"],
                        threads=1)
        r1 = http_request(px.port, "POST", "/v1/completions", completion_body(),
                          headers={"X-Request-Id": "first-ok"})
        self.assertEqual(r1.status, 200, r1.body)
        r2 = http_request(px.port, "POST", "/v1/completions", completion_body(),
                          headers={"X-Request-Id": "second-fails"})
        got = [(q.header("x-request-id"), q.conn_id) for q in M.requests]
        self.assertEqual(got[0], ("first-ok", 0))
        self.assertEqual(got[1], ("second-fails", 0), "the second request did not reuse the "
                         "upstream connection, the case is not exercised: %r" % got)
        self.assertEqual([g for g in got if g[0] == "second-fails"], [("second-fails", 0)],
                         "%s: %s read the request, then pdproxy sent it again: %r"
                         % (what, role, got))
        self.assertErrorJson(r2, 502, what)

    def test_decode_reset_on_reused_connection_not_resent(self):
        self.check("decode", lambda: Reset(), "decode reset after reading the request")

    def test_decode_close_on_reused_connection_not_resent(self):
        self.check("decode", lambda: CloseBeforeHeaders(),
                   "decode closed after reading the request")

    def test_prefill_reset_on_reused_connection_not_resent_with_no_retries(self):
        self.check("prefill", lambda: Reset(),
                   "prefill reset after reading the request, --prefill-retries 0")


# --------------------------------------------------------------------------

WRK_LUA = r"""
local out = nil
local reqs = {}
local n = 0

function init(args)
  out = assert(io.open(os.getenv("HOSTILE_WRK_OUT"), "wb"))
  local h = {["Content-Type"] = "application/json"}
  reqs[1] = wrk.format("POST", "/v1/completions", h, os.getenv("HOSTILE_BODY_PLAIN"))
  reqs[2] = wrk.format("POST", "/v1/completions", h, os.getenv("HOSTILE_BODY_STREAM"))
end

function request()
  n = n + 1
  return reqs[(n % 2) + 1]
end

function response(status, headers, body)
  local ct = headers["Content-Type"] or headers["content-type"] or ""
  out:write(status, " ", #body, " ", #ct, "\n", ct, body, "\n")
  out:flush()
end

function done(summary, latency, requests)
  io.write(string.format(
    "WRKSUMMARY requests=%d connect=%d read=%d write=%d status=%d timeout=%d\n",
    summary.requests, summary.errors.connect, summary.errors.read, summary.errors.write,
    summary.errors.status, summary.errors.timeout))
end
"""

D_JSON = json.dumps({"id": "cmpl-d", "object": "text_completion",
                     "choices": [{"index": 0, "text": "fine", "finish_reason": "stop"}]}).encode()
D_SSE = sse_events(["fi", "ne"])


def split_stale(body, status):
    """wrk keeps the body bytes of a response whose connection was cut
    (pdproxy's documented way to fail a stream that already started) and
    prepends them to the next response it reads on the reconnected
    connection (wrk 4.1 resets its body buffer only when a response
    completes). Returns (final, stale): `final` is the response's own body
    (None when `body` is not some cut prefixes of decode's bodies followed by
    a whole body of the right kind), `stale` the bytes before it."""
    whole = (D_JSON, b"".join(D_SSE))

    def prefixes_only(b):
        ok = [False] * (len(b) + 1)
        ok[0] = True
        for i in range(len(b)):
            if not ok[i]:
                continue
            for w in whole:
                for j in range(i + 1, min(len(b), i + len(w)) + 1):
                    if b[i:j] != w[:j - i]:
                        break
                    ok[j] = True
        return ok[len(b)]

    if status == 200:
        cands = [len(body) - len(w) for w in whole if body.endswith(w)]
    else:
        cands = [i for i in range(len(body)) if body.startswith(b'{"error"', i)]
    for k in cands:
        if prefixes_only(body[:k]):
            return body[k:], body[:k]
    return None, None


class RandomResetLoadTest(UpstreamCase):
    DURATION = 30
    RESET_SHARE = 0.2

    def flaky_decode(self, seed):
        rng = random.Random(seed)
        lock = threading.Lock()
        counts = {}

        def h(req):
            stream = bool(req.json().get("stream"))
            with lock:
                roll = rng.random()
                point = rng.randrange(6)
                delay = rng.random() * 0.02
            if roll >= self.RESET_SHARE:
                kind = "ok"
                if stream:
                    act = Stream(200, [SSE], [(0, e) for e in D_SSE])
                else:
                    act = Respond(200, [JSONCT], D_JSON, framing=("length", "chunked")[point % 2])
            else:
                kind = "reset%d" % point
                body = b"".join(D_SSE) if stream else D_JSON
                cut = max(1, len(body) // 2)
                ct = SSE if stream else JSONCT
                if point == 0:  # right after reading the request
                    act = Reset()
                elif point == 1:  # a moment later
                    act = Reset(delay=delay)
                elif point == 2:  # after the head, before any body
                    act = Stream(200, [ct], [], end="reset")
                elif point == 3:  # mid-body, chunked, mid-event
                    act = Stream(200, [ct], [(0, body[:cut])], end="reset")
                elif point == 4:  # mid-body, Content-Length
                    act = Stream(200, [ct], [(0, body[:cut]), (delay, b"")], framing="length",
                                 length=len(body), end="reset")
                else:  # all but the last byte
                    act = Stream(200, [ct], [(0, body[:-1])], end="reset")
            with lock:
                counts[kind] = counts.get(kind, 0) + 1
            return act

        return h, counts

    def parse_responses(self, path):
        with open(path, "rb") as f:
            data = f.read()
        out, pos = [], 0
        for _ in range(MAX_LOOP):
            if pos >= len(data):
                break
            nl = data.index(b"\n", pos)
            status, blen, clen = (int(x) for x in data[pos:nl].split())
            pos = nl + 1
            ct = data[pos:pos + clen].decode("latin-1")
            pos += clen
            body = data[pos:pos + blen]
            pos += blen
            self.assertEqual(data[pos:pos + 1], b"\n", "wrk output out of step at %d" % pos)
            pos += 1
            out.append((status, ct, body))
        return out

    def test_decode_resets_at_random_under_wrk(self):
        wrk = shutil.which("wrk")
        if not wrk:
            self.skipTest("wrk not installed (Debian package wrk; deploy/local/install-deps.sh)")
        P = self.mock(prefill_handler(), name="P")
        handler, counts = self.flaky_decode(7)
        D = self.mock(handler, name="D")
        px = self.start([P], [D], ["--decode-idle-timeout", "4", "--prefill-timeout", "4",
                                   "--unhealthy-after", "1000", "--health-interval", "1"])
        pid = px.proc.pid
        base_fds = len(os.listdir("/proc/%d/fd" % pid))
        tmp = tempfile.mkdtemp(prefix="hostile-wrk-")
        self.addCleanup(shutil.rmtree, tmp, True)
        lua = os.path.join(tmp, "post.lua")
        with open(lua, "w") as f:
            f.write(WRK_LUA)
        outp = os.path.join(tmp, "responses")
        env = dict(os.environ, HOSTILE_WRK_OUT=outp,
                   HOSTILE_BODY_PLAIN=json.dumps(completion_body(prompt="load")),
                   HOSTILE_BODY_STREAM=json.dumps(completion_body(prompt="load",
                                                                  stream=True)))
        cmd = [wrk, "-t1", "-c16", "-d%ds" % self.DURATION, "--timeout", "10s", "-s", lua,
               "http://%s:%d/v1/completions" % (HOST, px.port)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                           timeout=self.DURATION + 60)
        self.assertEqual(p.returncode, 0, "wrk failed: %s %s" % (p.stdout, p.stderr))
        self.assertTrue(px.alive(), "pdproxy died under load with resetting decode")
        m = re.search(r"WRKSUMMARY requests=(\d+) connect=(\d+) read=(\d+) write=(\d+) "
                      r"status=(\d+) timeout=(\d+)", p.stdout)
        self.assertIsNotNone(m, p.stdout)
        total, e_conn, e_read, e_write, e_status, e_timeout = (int(x) for x in m.groups())
        resp = self.parse_responses(outp)
        by_status = {}
        for st, ct, body in resp:
            by_status[st] = by_status.get(st, 0) + 1
        ids = {}
        for q in list(D.requests):
            rid = q.header("x-request-id")
            ids[rid] = ids.get(rid, 0) + 1
        resent = sum(1 for v in ids.values() if v > 1)
        sys.stderr.write("\n[wrk] %d responses %r; socket errors connect=%d read=%d write=%d "
                         "timeout=%d; decode actions %r; decode requests sent twice or more: %d "
                         "(see NoSilentResendTest)\n"
                         % (total, sorted(by_status.items()), e_conn, e_read, e_write, e_timeout,
                            sorted(counts.items()), resent))
        self.assertEqual(len(resp), total, "wrk's count and the responses recorded differ")
        self.assertGreater(total, 20 * self.DURATION, "pdproxy served only %d requests in %ds"
                           % (total, self.DURATION))
        self.assertEqual(e_conn, 0, "pdproxy refused connections under load")
        self.assertEqual(e_timeout, 0, "requests hung past 10 s (timeouts are 4 s)")
        bad = []
        stale_seen = 0
        for st, ct, body in resp:
            if st not in (200, 502, 503, 504):
                bad.append((st, ct, body[:200]))
                continue
            final, stale = split_stale(body, st)
            if final is None:
                bad.append((st, ct, body[:300]))
                continue
            stale_seen += bool(stale)
            if st == 200:
                continue
            try:
                doc = strict_json(final)
                ok = (ct.split(";")[0].strip() == "application/json"
                      and isinstance(doc.get("error"), dict)
                      and doc["error"].get("code") == st
                      and isinstance(doc["error"].get("message"), str)
                      and isinstance(doc["error"].get("type"), str))
            except (ValueError, AttributeError):
                ok = False
            if not ok:
                bad.append((st, ct, body[:300]))
        # A stale prefix is what wrk kept of a stream pdproxy cut; there
        # cannot be more of them than connections wrk saw cut.
        self.assertLessEqual(stale_seen, e_read, "more responses carry a cut stream's bytes "
                             "than wrk saw cut connections")
        self.assertEqual(bad[:10], [], "%d improper responses (of %d)" % (len(bad), len(resp)))
        self.assertGreater(by_status.get(200, 0), total // 2, "too few successes: %r" % by_status)
        self.assertGreater(by_status.get(502, 0), 0, "no 502 seen: did decode reset at all? %r"
                           % counts)
        # Afterwards: alive, healthy, nothing left in flight, no leaked sockets.
        D.set_handler(decode_handler())
        self.assertEqual(http_request(px.port, "GET", "/health").status, 200)
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)
        self.assertTrue(wait_until(
            lambda: metric(prom(px.port), "pdproxy_inflight_requests") == 0, 5.0, 0.05),
            "requests still in flight after the load ended")
        fds = wait_until(lambda: len(os.listdir("/proc/%d/fd" % pid)) <= base_fds + 40,
                         10.0, 0.05)
        self.assertTrue(fds, "pdproxy holds %d fds after the load, %d before"
                        % (len(os.listdir("/proc/%d/fd" % pid)), base_fds))


if __name__ == "__main__":
    main()
