#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Connections: client keep-alive, upstream connection reuse, HTTP/1.0
clients, worker threads under parallel load, cancelling P when the client
goes away."""

import json
import os
import threading
import time

from pdharness.case import PxTestCase, main
from pdharness.client import RawClient, http_request, raw_exchange, strict_json
from pdharness.mocks import (Hang, Respond, Stream, chat_body, completion_body, decode_handler,
                             prefill_handler, sse_events)
from pdharness.net import read_by_peer, wait_until, wait_value
from pdharness.prom import metric, prom


def echo_decode(req):
    """D answer naming the client's prompt, to catch cross-talk between requests."""
    prompt = strict_json(req.body)["prompt"]
    body = json.dumps({"choices": [{"text": "echo:" + prompt}]}).encode()
    return Respond(200, [("Content-Type", "application/json")], body)


def slow_echo_decode(req):
    r = echo_decode(req)
    r.delay = 0.3
    return r


class KeepAliveTest(PxTestCase):
    def setUp(self):
        super().setUp()
        self.P = self.mock(prefill_handler(), name="P")
        self.D = self.mock(echo_decode, name="D")

    def test_client_keepalive_and_upstream_reuse(self):
        px = self.start_proxy([self.P], [self.D], threads=1)
        c = RawClient(px.port)
        self.addCleanup(c.close)
        n = 6
        for i in range(n):
            c.request("POST", "/v1/completions", completion_body(prompt="ka-%d" % i))
            r = c.read_response(timeout=5)
            self.assertEqual(r.status, 200, r)
            self.assertTrue(r.complete, r)
            self.assertFalse(r.eof, "pdproxy closed a keep-alive connection after request %d" % i)
            self.assertNotEqual((r.header("connection") or "").lower(), "close")
            self.assertEqual(r.json(), {"choices": [{"text": "echo:ka-%d" % i}]})
        self.assertEqual(len(self.P.requests), n)
        self.assertEqual(len(self.D.requests), n)
        p_conns = set(self.P.conn_ids())
        d_conns = set(self.D.conn_ids())
        self.assertLess(len(p_conns), n, "no upstream reuse towards P: conns %r" % self.P.conn_ids())
        self.assertLess(len(d_conns), n, "no upstream reuse towards D: conns %r" % self.D.conn_ids())

    def burst(self, px, n):
        """n requests at once, each on its own client connection."""
        results = []

        def one(i):
            results.append(http_request(px.port, "POST", "/v1/completions",
                                        completion_body(prompt="burst-%d" % i)).status)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        self.assertEqual(results, [200] * n)

    def closed_by_proxy(self, mock):
        """Connections that carried requests and pdproxy closed."""
        ids = set(mock.conn_ids())
        return sum(1 for c in mock.conns if c.id in ids and c.closed_by_peer)

    def test_upstream_keepalive_caps_idle_connections(self):
        # D holds every answer a moment, so the burst needs one upstream
        # connection per request; afterwards pdproxy keeps two idle and
        # closes the rest at once.
        self.D.set_handler(slow_echo_decode)
        px = self.start_proxy([self.P], [self.D], threads=1,
                              extra=["--upstream-keepalive", "2"])
        self.burst(px, 6)
        self.assertEqual(len(set(self.D.conn_ids())), 6, "expected one D connection per request")
        self.assertTrue(wait_until(lambda: self.closed_by_proxy(self.D) == 4, 3.0),
                        "pdproxy closed %d of 6 D connections, expected 4" %
                        self.closed_by_proxy(self.D))
        # The two kept serve the next requests: no new connection.
        for i in range(2):
            self.assertEqual(http_request(px.port, "POST", "/v1/completions",
                                          completion_body(prompt="again")).status, 200)
        self.assertEqual(len(set(self.D.conn_ids())), 6,
                         "the idle connections kept were not reused")

    def test_upstream_keepalive_default_keeps_a_burst(self):
        self.D.set_handler(slow_echo_decode)
        px = self.start_proxy([self.P], [self.D], threads=1)
        self.burst(px, 6)
        # Below the cap pdproxy would close an idle connection when it comes
        # back to the pool, as the capped test shows, at once. A second
        # burst, answered 0.3 s late, is served by the six kept: by its end
        # the mock has long seen any such close.
        self.burst(px, 6)
        self.assertEqual(self.closed_by_proxy(self.D), 0,
                         "idle upstream connections closed below the default cap")
        self.assertEqual(len(set(self.D.conn_ids())), 6,
                         "the second burst opened new D connections: %r" % self.D.conn_ids())

    def test_upstream_reuse_after_streams(self):
        events = sse_events(["x", "y"])
        self.D.set_handler(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                              [(0, e) for e in events]))
        px = self.start_proxy([self.P], [self.D], threads=1)
        n = 5
        for i in range(n):
            # A fresh client connection each time: reuse is pdproxy's doing.
            r = raw_exchange(px.port, "POST", "/v1/completions",
                             completion_body(stream=True))
            self.assertEqual(r.status, 200)
            self.assertTrue(r.complete, r)
            self.assertEqual(bytes(r.body), b"".join(events))
        self.assertLess(len(set(self.D.conn_ids())), n, "D conns %r" % self.D.conn_ids())
        self.assertLess(len(set(self.P.conn_ids())), n, "P conns %r" % self.P.conn_ids())

    def test_keepalive_across_streams(self):
        events = sse_events(["s1", "s2"])
        px = self.start_proxy([self.P], [self.D], threads=1)
        c = RawClient(px.port)
        self.addCleanup(c.close)
        for i in range(4):
            if i % 2:
                self.D.set_handler(echo_decode)
            else:
                self.D.set_handler(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                                      [(0.01, e) for e in events]))
            c.request("POST", "/v1/completions", completion_body(prompt="m%d" % i,
                                                                         stream=not i % 2))
            r = c.read_response(timeout=5)
            self.assertEqual(r.status, 200, r)
            self.assertChunkedComplete(r)
            self.assertFalse(r.eof, "connection closed after request %d" % i)
            if i % 2:
                self.assertEqual(r.json(), {"choices": [{"text": "echo:m%d" % i}]})
            else:
                self.assertEqual(r.header("content-type"), "text/event-stream")
                self.assertEqual(bytes(r.body), b"".join(events))

    def test_upstream_closes_idle_connection(self):
        # Engines close idle keep-alive connections (uvicorn: after 5 s). A
        # pooled connection the backend has closed must not fail a request.
        def p(req):
            a = prefill_handler()(req)
            a.then_close = True
            return a

        def d(req):
            a = echo_decode(req)
            a.then_close = True
            return a

        self.P.set_handler(p)
        self.D.set_handler(d)
        px = self.start_proxy([self.P], [self.D], threads=1)
        for i in range(4):
            r = http_request(px.port, "POST", "/v1/completions",
                             completion_body(prompt="idle-%d" % i))
            self.assertEqual(r.status, 200, "request %d: %r" % (i, r.body))
            self.assertEqual(r.json(), {"choices": [{"text": "echo:idle-%d" % i}]})
            # Let the FINs arrive before the next request.
            wait_until(lambda: all(r.conn.closed.is_set()
                                   for r in self.P.requests + self.D.requests), 1.0)

    def test_keepalive_mixed_paths_and_errors(self):
        px = self.start_proxy([self.P], [self.D], threads=1)
        c = RawClient(px.port)
        self.addCleanup(c.close)
        c.request("GET", "/healthcheck")
        r = c.read_response(method="GET")
        self.assertEqual(r.status, 200)
        c.request("POST", "/v1/completions", b"not json")
        r = c.read_response()
        self.assertEqual(r.status, 400)
        self.assertTrue(r.complete)
        if r.eof:
            return  # closing after an error is allowed
        c.request("POST", "/v1/chat/completions", chat_body(prompt="z"))
        r = c.read_response()
        self.assertEqual(r.status, 200, r)

    def test_pipelined_healthchecks(self):
        px = self.start_proxy([self.P], [self.D], threads=1)
        c = RawClient(px.port)
        self.addCleanup(c.close)
        c.send(RawClient.build("GET", "/healthcheck") * 3)
        for i in range(3):
            r = c.read_response(timeout=5, method="GET")
            self.assertEqual(r.status, 200, "pipelined response %d: %r" % (i, r))
            self.assertEqual(r.json()["status"], "ok")

    def test_http10_client(self):
        px = self.start_proxy([self.P], [self.D])
        c = RawClient(px.port)
        self.addCleanup(c.close)
        c.request("POST", "/v1/completions", completion_body(prompt="old"),
                  version="HTTP/1.0")
        r = c.read_response(timeout=5)
        self.assertEqual(r.status, 200, r)
        self.assertNotEqual(r.framing, "chunked", "chunked sent to an HTTP/1.0 client")
        self.assertTrue(r.complete, r)
        self.assertEqual(r.json(), {"choices": [{"text": "echo:old"}]})


class ThreadsTest(PxTestCase):

    def test_parallel_clients_threads_4(self):
        ps = [self.mock(prefill_handler(), name="p%d" % i) for i in range(2)]
        ds = [self.mock(echo_decode, name="d%d" % i) for i in range(2)]
        px = self.start_proxy(ps, ds, threads=4)
        n_clients, n_each = 24, 3
        failures = []
        ids = []
        lock = threading.Lock()

        def client(k):
            try:
                for j in range(n_each):
                    prompt = "c%d-r%d" % (k, j)
                    r = http_request(px.port, "POST", "/v1/completions",
                                     completion_body(prompt=prompt), timeout=20)
                    ok = (r.status == 200 and r.json() == {"choices": [{"text": "echo:" + prompt}]})
                    with lock:
                        ids.append(r.header("x-request-id"))
                        if not ok:
                            failures.append((prompt, r.status, r.body[:200]))
            except Exception as e:
                with lock:
                    failures.append((k, repr(e)))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        self.assertFalse(any(t.is_alive() for t in threads), "clients still running")
        self.assertEqual(failures, [])
        total = n_clients * n_each
        self.assertEqual(sum(len(m.requests) for m in ps), total)
        self.assertEqual(sum(len(m.requests) for m in ds), total)
        self.assertEqual(len(set(ids)), total, "request ids not unique")

    def test_parallel_streams_threads_4(self):
        P = self.mock(prefill_handler(), name="P")
        events = sse_events(["a", "b", "c"])
        D = self.mock(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         [(0.05, e) for e in events]), name="D")
        px = self.start_proxy([P], [D], threads=4)
        results = []
        lock = threading.Lock()

        def client():
            try:
                r = raw_exchange(px.port, "POST", "/v1/completions",
                                 completion_body(stream=True), timeout=20)
                ok = r.status == 200 and r.complete and bytes(r.body) == b"".join(events)
            except Exception as e:
                ok = repr(e)
            with lock:
                results.append(ok)

        threads = [threading.Thread(target=client) for _ in range(16)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        self.assertEqual(results, [True] * 16)
        # 16 streams of 4 x 50 ms run concurrently, not one after another (~3.2 s).
        self.assertLess(time.monotonic() - t0, 2.5)


def listeners_on(port):
    """Number of TCP sockets listening on 127.0.0.1:port (from /proc/net/tcp)."""
    n = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:
                n += 1
    return n


class ListenerTest(PxTestCase):

    def test_one_reuseport_listener_per_thread(self):
        # With --reuse-port: a socket of its own per worker, in the port's
        # SO_REUSEPORT group.
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([P], [D], threads=3, extra=["--reuse-port"])
        self.assertEqual(wait_until(lambda: listeners_on(px.port) == 3, 2.0) and 3,
                         3, "listeners on %d: %d" % (px.port, listeners_on(px.port)))

    def test_one_shared_listener_without_reuse_port(self):
        # Without it the workers share one socket that never set
        # SO_REUSEPORT (no other process can join it), and all serve.
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([P], [D], threads=3)
        self.assertEqual(listeners_on(px.port), 1)
        for _ in range(6):
            self.assertEqual(http_request(px.port, "POST", "/v1/completions",
                                          {"model": "m", "prompt": "x"}).status, 200)

    def test_default_threads_cpu_count(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([P], [D], threads=None, extra=["--reuse-port"])
        ncpu = len(os.sched_getaffinity(0))
        wait_until(lambda: listeners_on(px.port) >= ncpu, 2.0)
        self.assertIn(listeners_on(px.port), (ncpu, os.cpu_count()))


class ClientBehaviourTest(PxTestCase):
    def setUp(self):
        super().setUp()
        self.P = self.mock(prefill_handler(), name="P")
        self.D = self.mock(echo_decode, name="D")

    def test_expect_100_continue(self):
        # curl sends "Expect: 100-continue" before large bodies.
        px = self.start_proxy([self.P], [self.D])
        body = json.dumps(completion_body(prompt="e" * 2_000_000)).encode()
        c = RawClient(px.port)
        self.addCleanup(c.close)
        c.send(RawClient.build("POST", "/v1/completions", None,
                               [("Content-Type", "application/json"),
                                ("Content-Length", str(len(body))),
                                ("Expect", "100-continue")]))
        # A client waits (curl: 1 s) for "100 Continue" before it sends the body.
        interim = c.read_response(timeout=0.5, head_only=True, return_interim=True)
        self.assertFalse(interim.timed_out, "no 100 Continue within 0.5 s")
        self.assertEqual(interim.status, 100, "expected 100 Continue, got %r" % interim)
        c.send(body)
        r = c.read_response(timeout=10)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(strict_json(self.P.requests[0].body)["prompt"], "e" * 2_000_000)

    def test_client_gone_before_body_complete(self):
        px = self.start_proxy([self.P], [self.D])
        c = RawClient(px.port)
        c.send(RawClient.build("POST", "/v1/completions", None,
                               [("Content-Type", "application/json"),
                                ("Content-Length", "1000")]) + b'{"prompt":"tr')
        # Client connections open, this one and the scrape's own.
        conns = lambda: metric(prom(px.port), "pdproxy_client_connections")
        self.assertGreaterEqual(wait_value(conns, lambda n: n >= 2, 5.0), 2)
        c.close()
        # pdproxy dropped the connection: the request it never completed
        # went nowhere.
        self.assertLessEqual(wait_value(conns, lambda n: n <= 1, 5.0), 1)
        self.assertEqual(self.P.requests, [])
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)

    def test_connection_close_honoured(self):
        px = self.start_proxy([self.P], [self.D])
        c = RawClient(px.port)
        self.addCleanup(c.close)
        c.request("POST", "/v1/completions", completion_body(prompt="bye"),
                  headers=[("Connection", "close")])
        r = c.read_response(timeout=5)
        self.assertEqual(r.status, 200, r)
        self.assertTrue(r.complete, r)
        self.assertTrue(c.wait_eof(2.0), "pdproxy kept a Connection: close connection open")


class ChurnTest(PxTestCase):

    def test_clients_leaving_at_every_stage(self):
        # Clients that leave while sending, during P, during D's headers,
        # mid-stream, and clients that stay, all at once. pdproxy must keep
        # serving (under ASan this also looks for use-after-free).
        events = sse_events(["t%d" % i for i in range(20)])

        def p(req):
            prompt = strict_json(req.body)["prompt"]
            if prompt.startswith("hang-p"):
                return Hang(max_s=5)
            return prefill_handler()(req)

        def d(req):
            prompt = strict_json(req.body)["prompt"]
            if prompt.startswith("hang-d"):
                return Hang(max_s=5)
            return Stream(200, [("Content-Type", "text/event-stream")],
                          [(0.01, e) for e in events])

        P = self.mock(p, name="P")
        D = self.mock(d, name="D")
        px = self.start_proxy([P], [D], threads=2)
        errors = []
        lock = threading.Lock()

        def client(kind, k):
            try:
                c = RawClient(px.port, timeout=10)
                prompt = "%s-%d" % (kind, k)
                body = json.dumps(completion_body(prompt=prompt, stream=True)).encode()
                if kind == "partial":
                    c.send(RawClient.build("POST", "/v1/completions", body)[:-5])
                    # Left after pdproxy read the partial request.
                    cport = c.sock.getsockname()[1]
                    if not wait_until(lambda: read_by_peer(cport, px.port), 5.0):
                        raise AssertionError("pdproxy did not read %s" % prompt)
                    c.close(rst=k % 2 == 1)
                    return
                c.request("POST", "/v1/completions", body)
                if kind in ("hang-p", "hang-d"):
                    # Left while the engine that hangs holds the request.
                    m = P if kind == "hang-p" else D
                    if not wait_until(lambda: any(r.json()["prompt"] == prompt
                                                  for r in list(m.requests)), 5.0):
                        raise AssertionError("%s never got %s" % (m.name, prompt))
                    c.close(rst=k % 2 == 1)
                    return
                if kind == "mid":
                    c.read_response(timeout=5, until=lambda r: len(r.body) > 0)
                    c.close(rst=k % 2 == 1)
                    return
                r = c.read_response(timeout=10)
                c.close()
                if not (r.status == 200 and r.complete and bytes(r.body) == b"".join(events)):
                    with lock:
                        errors.append((prompt, r))
            except Exception as e:
                with lock:
                    errors.append((kind, k, repr(e)))

        kinds = ["partial", "hang-p", "hang-d", "mid", "ok"]
        threads = [threading.Thread(target=client, args=(kinds[i % 5], i)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        self.assertEqual(errors, [])
        self.assertTrue(px.alive())
        r = raw_exchange(px.port, "POST", "/v1/completions",
                         completion_body(prompt="after", stream=True))
        self.assertEqual(r.status, 200)
        self.assertTrue(r.complete)
        # Every upstream connection of a departed client has been closed.
        for m, kind in ((P, "hang-p"), (D, "hang-d")):
            for req in m.requests:
                if req.json()["prompt"].startswith(kind):
                    self.assertIsNotNone(req.conn.wait_closed(2.0),
                                         "%s still open for %s" % (m.name, req.json()["prompt"]))


class CancelPrefillTest(PxTestCase):
    def setUp(self):
        super().setUp()
        self.P = self.mock(lambda req: Hang(max_s=10), name="P")
        self.D = self.mock(decode_handler(), name="D")

    def _cancel_during_p(self, rst):
        px = self.start_proxy([self.P], [self.D])
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body())
        reqs = self.P.wait_requests(1, timeout=5)
        self.assertEqual(len(reqs), 1, "P never got the request")
        pconn = reqs[0].conn
        t0 = c.close(rst=rst)
        t_closed = pconn.wait_closed(3.0)
        self.assertIsNotNone(t_closed, "pdproxy kept waiting on P after the client left")
        self.assertTrue(pconn.closed_by_peer)
        self.assertLessEqual(t_closed - t0, 0.3, "P closed %.0f ms after the client left"
                             % ((t_closed - t0) * 1000))
        # The request ended: a wrong D request would have been made by then.
        self.wait_access(px, outcome="client_disconnected")
        self.assertEqual(self.D.requests, [])
        # pdproxy still serves.
        self.P.set_handler(prefill_handler())
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)

    def test_client_close_cancels_p(self):
        self._cancel_during_p(rst=False)

    def test_client_reset_cancels_p(self):
        self._cancel_during_p(rst=True)

    def test_no_decode_after_client_left(self):
        # P answers 0.4 s later whatever happens: pdproxy told it the client
        # left (its write side shut at the grace's end) but still reads, so
        # an answer means P published blocks (issue 41: cutting here
        # stranded them). D is then given the request only to release them:
        # sent, aborted, counted; nobody's answer is read.
        def slow_p(req):
            time.sleep(0.4)  # the late answer the test is about
            return prefill_handler()(req)

        self.P.set_handler(slow_p)
        px = self.start_proxy([self.P], [self.D])
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body())
        self.assertEqual(len(self.P.wait_requests(1, timeout=5)), 1)
        c.close()
        self.assertIsNotNone(self.P.requests[0].conn.wait_closed(1.0),
                             "P not told that the client left")
        released = wait_value(lambda: metric(prom(px.port),
                                             "pdproxy_stranded_blocks_released_total"),
                              lambda v: v == 1, 3.0)
        self.assertEqual(released, 1, "P's late answer not released through D")
        self.assertEqual(len(self.D.requests), 1)
        self.assertIsNotNone(self.D.requests[0].conn.wait_closed(2.0),
                             "the release's D request was not aborted")


if __name__ == "__main__":
    main()
