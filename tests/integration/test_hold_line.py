#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 18, "hold the line": one test class per observation.

1. A client that never reads cannot grow pdproxy: pipelined requests wait
   while its output is above the high-water mark, and a peer that reads
   nothing for --send-timeout is closed; /metrics can need the API key or
   live on a listener of its own.
2. Request bodies share one process-wide budget (--max-buffered-bytes):
   beyond it 503 + Retry-After, counted; --max-connections refuses clearly.
3. Passive ejection never turns one error into an outage: the retries of a
   request count once, a lone ejected backend still gets traffic (panic
   routing, counted) and comes back on its first success.
4. A client leaving after prefill's response head cancels the prefill.
5. SIGHUP is logged and ignored.
6. A port already served is refused (exit 2) unless --reuse-port.
7. HEAD and 204 framed per RFC 9112.
8. X-Request-Id restricted as README says; Host required once in HTTP/1.1.
9. Backend names resolved asynchronously: a DNS server that never answers
   neither delays start-up nor stalls requests, and /ready names it."""

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest

from pdharness.case import main
from pdharness.client import RawClient, errmsg, http_request
from pdharness.mocks import (Hang, Respond, Stream, completion_body, decode_handler,
                             prefill_handler, sse_events)
from pdharness.net import (HOST, MAX_LOOP, connect_refused, free_port, listening_inodes, now,
                           read_by_peer, socket_inodes, wait_until)
from pdharness.namespace import STALL_DNS, StallingDns, mount_prefix, unshare_usable
from pdharness.procs import PDPROXY, Proxy, ProxyStartError, rss_bytes
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom


def has_conn_from(pid, client_port):
    """Whether process `pid` still holds a TCP socket whose peer is
    127.0.0.1:client_port."""
    mine = socket_inodes(pid)
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == client_port and fields[9] in mine:
                return True
    return False


def send_for(sock, data, seconds):
    """Sends as much of data as the peer takes within `seconds`; returns the
    count sent (a proxy that stops reading makes this stop early)."""
    sock.setblocking(False)
    sent, deadline = 0, now() + seconds
    for _ in range(MAX_LOOP):
        if sent >= len(data) or now() >= deadline:
            break
        try:
            sent += sock.send(data[sent:sent + 65536])
        except BlockingIOError:
            time.sleep(0.01)  # pacing: the peer reads when it reads
        except OSError:
            break
    sock.setblocking(True)
    return sent


METRICS_REQ = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


class NonReadingClientTest(ProdCase):
    """Item 1: 6.8 MB of pipelined GET /metrics from a client that reads
    nothing became 1.24 GB of RSS."""

    def pd(self, extra=()):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        return self.start([P], [D], list(extra), threads=1)

    def test_pipelined_metrics_to_non_reader_bounded(self):
        px = self.pd()
        pid = px.proc.pid
        base = rss_bytes(pid)
        c = RawClient(px.port, rcvbuf=4096)
        # Unbounded, 20 000 of these grew pdproxy by ~93 MiB; 40 000 are sent
        # (as many as it reads within 4 s). The limit leaves room for a
        # sanitizer build's quarantine.
        sent = send_for(c.sock, METRICS_REQ * 40000, 4.0)
        # What pdproxy read it may still be parsing and answering into its
        # buffers; nothing marks the end of that, so it gets 1 s before
        # the memory is measured.
        time.sleep(1.0)
        grown = rss_bytes(pid) - base
        held = metric(prom(px.port), "pdproxy_buffered_bytes")
        c.close(rst=True)
        self.assertLess(grown, 64 << 20, "pdproxy grew %d MiB for a client that reads nothing "
                        "(%d request bytes sent)" % (grown >> 20, sent))
        self.assertLess(held, 2 << 20, "queued output pdproxy counts for one non-reader")
        # Still serving others.
        r = http_request(px.port, "GET", "/health")
        self.assertEqual(r.status, 200)

    def test_non_reader_closed_after_send_timeout(self):
        px = self.pd(["--send-timeout", "1", "--keepalive-timeout", "1"])
        pid = px.proc.pid
        c = RawClient(px.port, rcvbuf=4096)
        c.request("GET", "/health")  # accepted and served before the flood
        self.assertEqual(c.read_response(method="GET").status, 200)
        port = c.sock.getsockname()[1]
        self.assertTrue(has_conn_from(pid, port))
        send_for(c.sock, METRICS_REQ * 400, 2.0)
        gone = wait_until(lambda: not has_conn_from(pid, port), 8.0, 0.05)
        c.close(rst=True)
        self.assertTrue(gone, "a connection whose peer read nothing is still open 8 s later "
                        "with --send-timeout 1")
        self.assertWarnedOrInfo(px, "send-timeout")

    def assertWarnedOrInfo(self, px, keyword):
        self.assertTrue(wait_until(lambda: keyword in px.stderr(), 2.0),
                        "no log line naming %s:\n%s" % (keyword, px.stderr()[-3000:]))

    def test_slow_reader_still_gets_everything(self):
        # A reader that is slow but steady is not cut: 200 pipelined /metrics
        # read after a pause arrive complete and in order.
        px = self.pd(["--send-timeout", "3"])
        c = RawClient(px.port, rcvbuf=4096)
        c.send(METRICS_REQ * 200)
        time.sleep(1.0)  # the reader's pause: the scenario
        for i in range(200):
            r = c.read_response(method="GET")
            self.assertEqual(r.status, 200, "response %d: %r" % (i, r))
            self.assertIn(b"pdproxy_", bytes(r.body)[:4000])
        c.close()

    def test_metrics_behind_api_key(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--api-key", "sekret", "--metrics-auth"])
        r = http_request(px.port, "GET", "/metrics")
        self.assertErrorJson(r, 401)
        r = http_request(px.port, "GET", "/metrics", headers={"Authorization": "Bearer sekret"})
        self.assertEqual(r.status, 200)
        # Probes stay open: a kubelet sends no key.
        self.assertEqual(http_request(px.port, "GET", "/health").status, 200)

    def test_metrics_on_own_listener(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        mport = free_port()
        px = self.start([P], [D], ["--metrics-host", HOST, "--metrics-port", str(mport)])
        self.assertTrue(wait_until(lambda: not connect_refused(mport), 3.0))
        r = http_request(px.port, "GET", "/metrics")
        self.assertErrorJson(r, 404)
        r = http_request(mport, "GET", "/metrics")
        self.assertEqual(r.status, 200)
        self.assertIn(b"pdproxy_requests_total", r.body)
        self.assertEqual(http_request(mport, "GET", "/ready").status, 200)
        r = http_request(mport, "POST", "/v1/completions", completion_body())
        self.assertErrorJson(r, 404)
        self.assertEqual(P.requests, [])


class BodyBudgetTest(ProdCase):
    """Item 2: stalled bodies and bodies waiting on a hung prefill have no
    global bound."""

    MiB = 1 << 20

    def test_stalled_bodies_then_503(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--max-buffered-bytes", str(4 * self.MiB)])
        # Announced lengths that fit are admitted; the budget is taken as
        # the bytes arrive.
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % int(1.6 * self.MiB))
        stalled = []
        for i in range(2):
            c = RawClient(px.port)
            c.send(head + b" " * int(1.5 * self.MiB))
            stalled.append(c)
        # Let pdproxy read what was sent before the third body arrives.
        self.assertTrue(wait_until(
            lambda: metric(prom(px.port), "pdproxy_buffered_bytes") >= 3 * self.MiB, 5.0, 0.05),
            "the stalled bodies never reached pdproxy")
        body = json.dumps({"model": "m", "prompt": "x" * (2 * self.MiB)}).encode()
        c = RawClient(px.port)
        send_for(c.sock, RawClient.build("POST", "/v1/completions", body), 3.0)
        r = c.read_response(timeout=10)
        c.close()
        self.assertErrorJson(r, 503)
        self.assertTrue(r.header("retry-after"), r.raw_head)
        self.assertIn("memory", errmsg(r).lower())
        self.assertEqual(metric(prom(px.port), "pdproxy_buffer_budget_rejected_total"), 1)
        self.assertEqual(P.requests, [])
        for s in stalled:
            s.close()
        # The budget comes back when the stalled clients leave.
        ok = wait_until(lambda: self.post(px, {"model": "m", "prompt": "y" * self.MiB})
                        .status == 200, 5.0, 0.2)
        self.assertTrue(ok, "budget not returned after the stalled clients left")

    def test_bodies_waiting_on_hung_prefill_bounded(self):
        P = self.mock(lambda req: Hang(20.0), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--max-buffered-bytes", str(8 * self.MiB)])
        body = {"model": "m", "prompt": "z" * (3 * self.MiB)}
        first = RawClient(px.port)
        first.request("POST", "/v1/completions", body)
        P.wait_requests(1, timeout=5)
        r = self.post(px, body)
        self.assertErrorJson(r, 503)
        self.assertIn("memory", errmsg(r).lower())
        first.close()
        self.assertTrue(wait_until(lambda: metric(prom(px.port), "pdproxy_inflight_requests") == 0,
                                   3.0))

    def test_max_connections(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        mport = free_port()
        px = self.start([P], [D], ["--max-connections", "4", "--metrics-host", HOST,
                                   "--metrics-port", str(mport)], threads=1)
        # Scraped on the metrics listener, whose connections the limit does
        # not count (a scrape on the main port would count itself, and its
        # close races the connections below). The readiness probe's
        # connection may not be reaped yet: wait until none is left.
        self.assertTrue(wait_until(lambda: not connect_refused(mport), 3.0))
        self.assertTrue(wait_until(
            lambda: metric(prom(mport), "pdproxy_client_connections") == 0, 3.0, 0.02))
        held = [RawClient(px.port) for _ in range(4)]
        for h in held:  # accepted before the next one arrives
            h.request("GET", "/health")
            self.assertEqual(h.read_response(method="GET").status, 200)
        extra = RawClient(px.port)
        extra.request("GET", "/health")
        r = extra.read_response(method="GET", timeout=5)
        self.assertErrorJson(r, 503)
        self.assertIn("max-connections", errmsg(r))
        self.assertTrue(extra.wait_eof(3.0), "refused connection left open")
        extra.close()
        held[0].close()
        ok = wait_until(lambda: http_request(px.port, "GET", "/health").status == 200, 3.0, 0.05)
        self.assertTrue(ok, "a slot freed by a closed connection was not reused")
        for h in held[1:]:
            h.close()
        self.assertTrue(wait_until(
            lambda: http_request(px.port, "GET", "/health").status == 200, 3.0, 0.05))
        self.assertGreaterEqual(metric(prom(mport), "pdproxy_connections_refused_total"), 1)


class NoSelfInflictedOutageTest(ProdCase):
    """Item 3: a single 5xx on the only prefill ejected it."""

    def flaky(self, fails):
        left = [fails]
        lock = threading.Lock()
        ok = prefill_handler()

        def h(req):
            with lock:
                left[0] -= 1
                bad = left[0] >= 0
            if bad:
                return Respond(500, [("Content-Type", "application/json")], b'{"error":"boom"}')
            return ok(req)

        return h

    def test_one_failed_request_does_not_eject_the_only_prefill(self):
        # Defaults: --unhealthy-after 3, --prefill-retries 2: one request and
        # its two retries on the only prefill are one failure, not three.
        P = self.mock(self.flaky(3), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D])
        r = self.post(px)
        self.assertEqual(r.status, 502, r)
        self.assertEqual(len(P.requests), 3)
        r = self.post(px)
        self.assertEqual(r.status, 200, "after one failed request: %r" % (bytes(r.body)[:300],))
        self.assertEqual(self.up(px, "prefill", P), 1)

    def test_lone_ejected_prefill_still_routed_and_readmitted(self):
        P = self.mock(self.flaky(1), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--unhealthy-after", "1", "--prefill-retries", "0"])
        self.assertEqual(self.post(px).status, 502)
        self.assertEqual(self.up(px, "prefill", P), 0, "ejected after one failure")
        r = self.post(px)
        self.assertEqual(r.status, 200, "every prefill ejected must not mean an outage: %r"
                         % (bytes(r.body)[:300],))
        self.assertEqual(self.up(px, "prefill", P), 1, "not readmitted on its first success")
        s = prom(px.port)
        self.assertGreaterEqual(metric(s, "pdproxy_panic_routed_total", role="prefill"), 1)

    def test_health_checked_down_backend_still_refused(self):
        # What an engine's own /health says is believed: no panic routing to
        # a backend failing its checks (it is loading, or broken).
        P = self.mock(prefill_handler(), name="P")
        P.probe_handler = lambda req: Respond(503, [], b"")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--health-interval", "0.1", "--unhealthy-after", "1"],
                        health_interval=None)
        self.wait_up(px, "prefill", P, 0, 3.0)
        self.assertErrorJson(self.post(px), 503)
        self.assertEqual(P.requests, [])


class LeaveAfterPrefillHeadTest(ProdCase):
    """Item 4: with prefill stalling after its response head, a client
    that left stayed in flight until --prefill-timeout."""

    def test_prefill_cancelled_when_client_leaves_after_its_head(self):
        P = self.mock(lambda req: Stream(200, [("Content-Type", "application/json")],
                                         [(20.0, b"{}")], framing="length", length=2), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--max-inflight", "1"])
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body())
        P.wait_requests(1, timeout=5)
        conn = P.requests[0].conn
        # The client leaves once pdproxy has read the prefill's head.
        self.assertTrue(wait_until(lambda: conn.bytes_sent > 0 and
                                   read_by_peer(conn.local_port, conn.peer_port), 3.0),
                        "mock sent no head, or pdproxy did not read it")
        t0 = now()
        c.close()
        # A prefill that started answering gets 2 s to finish (its blocks
        # could then be released through decode), not --prefill-timeout.
        t = conn.wait_closed(5.0)
        self.assertIsNotNone(t, "prefill connection still open 5 s after the client left")
        self.assertLess(t - t0, 3.0)
        self.assertTrue(wait_until(
            lambda: metric(prom(px.port), "pdproxy_inflight_requests") == 0, 2.0))
        P.set_handler(prefill_handler())
        self.assertEqual(self.post(px).status, 200, "the in-flight slot was not returned")


class SighupTest(ProdCase):
    """Item 5: SIGHUP killed pdproxy mid-stream."""

    def test_sighup_logged_and_ignored(self):
        events = sse_events(["a", "b", "c", "d"])
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         [(0.3, e) for e in events]), name="D")
        px = self.start([P], [D])
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body(stream=True))
        sent = []

        def hup(resp):
            if not sent and len(resp.body):
                px.proc.send_signal(signal.SIGHUP)
                sent.append(now())

        r = c.read_response(timeout=10, on_progress=hup)
        c.close()
        self.assertTrue(sent, "no event arrived")
        self.assertTrue(px.alive(), "pdproxy exited on SIGHUP")
        self.assertTrue(r.complete, r)
        self.assertEqual(bytes(r.body), b"".join(events))
        self.assertTrue(wait_until(lambda: "SIGHUP" in px.stderr(), 2.0), px.stderr()[-2000:])
        self.assertEqual(self.post(px).status, 200)


class PortInUseTest(ProdCase):
    """Item 6: a second pdproxy shared the port through SO_REUSEPORT."""

    def test_second_instance_refused(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D])
        p = subprocess.run([PDPROXY, "--host", HOST, "--port", str(px.port), "--threads", "2"]
                           + self.proxy_args([P], [D]), stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=10, env=Proxy.clean_env())
        self.assertEqual(p.returncode, 2, p.stderr.decode()[-2000:])
        self.assertIn("in use", p.stderr.decode().lower())
        self.assertTrue(px.owns_port(), "the first instance lost its port")

    def test_reuse_port_opt_in(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--reuse-port"])
        second = self.track_proxy(Proxy(["--host", HOST, "--port", str(px.port), "--reuse-port"]
                                        + self.proxy_args([P], [D]), port=px.port).spawn())
        # Started: it holds a listening socket on the shared port.
        listens = wait_until(lambda: not second.alive() or bool(
            listening_inodes(px.port) & socket_inodes(second.proc.pid)), 5.0, 0.02)
        self.assertTrue(second.alive() and listens, second.stderr())


class FramingTest(ProdCase):
    """Item 7: HEAD answered with a body; a decode 204 relayed chunked."""

    def test_head_has_no_body(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D])
        for path, want in (("/health", 200), ("/metrics", 200), ("/v1/completions", 405),
                           ("/nowhere", 404)):
            with self.subTest(path=path):
                c = RawClient(px.port)
                c.send(RawClient.build("HEAD", path) + RawClient.build("GET", "/health"))
                r1 = c.read_response(method="HEAD")
                self.assertEqual(r1.status, want, r1)
                r2 = c.read_response(method="GET")
                c.close()
                self.assertEqual(r2.status, 200, "the HEAD answer carried a body: %r" % r2)
                self.assertEqual(r2.json(), {"status": "ok"})

    def test_decode_204_has_no_body_framing(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(lambda req: Respond(204, [], b""), name="D")
        px = self.start([P], [D])
        c = RawClient(px.port)
        c.send(RawClient.build("POST", "/v1/completions", completion_body())
               + RawClient.build("GET", "/health"))
        r1 = c.read_response()
        self.assertEqual(r1.status, 204)
        self.assertIsNone(r1.header("transfer-encoding"), r1.raw_head)
        r2 = c.read_response(method="GET")
        c.close()
        self.assertEqual(r2.status, 200, "a body followed the 204: %r" % r2)


class RequestIdAndHostTest(ProdCase):
    """Item 8."""

    def test_request_id_with_space_quote_backslash_replaced(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D])
        for bad in ('a b"c\\d', "a b", 'q"q', "back\\slash"):
            with self.subTest(bad=bad):
                r = self.post(px, headers={"X-Request-Id": bad})
                self.assertEqual(r.status, 200)
                got = r.header("x-request-id")
                self.assertNotEqual(got, bad)
                self.assertRegex(got, r"^[0-9a-f-]{36}$")
                self.assertEqual(D.requests[-1].header("x-request-id"), got)
        r = self.post(px, headers={"X-Request-Id": "ok-id_1.2:3/x"})
        self.assertEqual(r.header("x-request-id"), "ok-id_1.2:3/x")

    def test_host_required_once(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D])
        for name, raw in (
                ("no Host", b"GET /health HTTP/1.1\r\n\r\n"),
                ("two Hosts", b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
                ("empty Host twice", b"GET /health HTTP/1.1\r\nHost:\r\nHost:\r\n\r\n")):
            with self.subTest(name):
                c = RawClient(px.port)
                c.send(raw)
                r = c.read_response(method="GET")
                c.close()
                self.assertErrorJson(r, 400)
                self.assertIn("host", errmsg(r).lower())
        c = RawClient(px.port)
        c.send(b"GET /health HTTP/1.0\r\n\r\n")
        self.assertEqual(c.read_response(method="GET").status, 200, "HTTP/1.0 needs no Host")
        c.close()
        c = RawClient(px.port)
        c.send(b"GET /health HTTP/1.1\r\nHost:\r\n\r\n")
        self.assertEqual(c.read_response(method="GET").status, 200, "an empty Host is valid")
        c.close()


@unittest.skipUnless(unshare_usable(), "needs root and unshare -m")
class AsyncDnsTest(ProdCase):
    """Item 9: names were resolved with a blocking resolver."""

    def test_stalling_dns_does_not_stall_start_or_requests(self):
        try:
            dns = StallingDns()
        except OSError as e:
            self.skipTest("cannot bind %s:53: %s" % (STALL_DNS, e))
        self.addCleanup(dns.close)
        files = []
        for text in ("127.0.0.1 localhost\n", "nameserver %s\noptions timeout:5 attempts:3\n"
                     % STALL_DNS):
            fd, path = tempfile.mkstemp(prefix="pdproxy-dns-")
            os.write(fd, text.encode())
            os.close(fd)
            files.append(path)
            self.addCleanup(os.unlink, path)
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        args = ["--health-interval", "0",
                "--prefiller-hosts", HOST, "--prefiller-ports", str(P.port),
                "--prefill", "http://stalled.pdproxy-test:%d" % P.port,
                "--decode", "http://%s:%d" % (HOST, D.port), "--dns-refresh", "0.5"]
        try:
            px = self.start_proxy(args=args, ready_timeout=3.0,
                                  prefix=mount_prefix(*files))
        except ProxyStartError as e:
            self.fail("a DNS server that never answers delayed start-up: %s" % e)
        self.assertTrue(wait_until(lambda: dns.queries > 0, 3.0), "no query reached the server")
        t0 = now()
        for i in range(20):
            r = self.post(px, timeout=5)
            self.assertEqual(r.status, 200, r)
        self.assertLess(now() - t0, 4.0, "requests stalled behind DNS")
        doc = http_request(px.port, "GET", "/ready").json()
        self.assertIn("stalled.pdproxy-test", json.dumps(doc.get("unresolved", [])), doc)
        self.assertWarned(px, "stalled.pdproxy-test", timeout=12.0)


if __name__ == "__main__":
    main()
