#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 30, "hold the line, third round": one test class per observation.

H1. No spelling of a P/D path smuggles a client's kv_transfer_params: the
    request target is normalised once (percent-decoding of unreserved
    characters and '/', dot segments, duplicate and trailing slashes),
    routed and forwarded normalised; and every JSON body the proxy forwards,
    on every route, loses the client's kv_transfer_params.
H2. A backend's bytes beyond the response it was asked for are never handed
    to a later request, on the prefill and on the decode leg.
M0. One header forwarding rule (an allow-list) for every route.
M1. The proxy's own listen address is refused as a backend (start, reload,
    admin API); a Via hop marker stops loops through other proxies (508).
M2. A reload that empties a pool is refused, the running configuration
    stays; toy defaults never apply behind a configuration file.
M4. Config files are bounded (16 MiB, 16 levels of nesting) and refused at
    once; a FIFO is refused instead of blocking the control thread.
M6. The disaggregation estimate counts what the engine renders besides the
    prompt: tools, functions, documents, chat_template, prompt_embeds.
Low items: one class each below."""

import json
import os
import signal
import threading
import time

from pdharness.case import main
from pdharness.client import RawClient, http_request
from pdharness.ctl import admin, pools_yaml, tmpdir, url, write_yaml
from pdharness.mocks import (Hang, Respond, chat_body, completion_body, decode_handler,
                             prefill_handler)
from pdharness.net import HOST, free_port
from pdharness.procs import Proxy, run_pdproxy
from pdharness.prod import AdminCase, ProdCase

EVIL = {"do_remote_prefill": True, "remote_host": "169.254.169.254", "remote_port": 80,
        "remote_engine_id": "evil", "remote_block_ids": [1], "remote_request_id": "evil"}
JSONCT = ("Content-Type", "application/json")


def has_evil(req):
    return b"169.254.169.254" in req.body


class PathSpellingTest(ProdCase):
    """H1: /v1/chat%2Fcompletions, /v1/chat/%63ompletions, /v1/%63ompletions,
    /v1//chat/completions and /v1/chat/completions/ reached decode with the
    client's kv_transfer_params intact."""

    SPELLINGS = {
        "/v1/chat%2Fcompletions": "/v1/chat/completions",
        "/v1/chat%2fcompletions": "/v1/chat/completions",
        "/v1/chat/%63ompletions": "/v1/chat/completions",
        "/v1/%63ompletions": "/v1/completions",
        "/v1//chat/completions": "/v1/chat/completions",
        "//v1/chat/completions": "/v1/chat/completions",
        "/v1/chat/completions/": "/v1/chat/completions",
        "/v1/./chat/completions": "/v1/chat/completions",
        "/v1/x/../chat/completions": "/v1/chat/completions",
        "/v1/chat/%2E%2E/chat/completions": "/v1/chat/completions",
        "/v2/../v1/completions?x=1": "/v1/completions",
        "http://h/v1//completions": "/v1/completions",
    }

    def test_spellings_are_routed_normalised_and_stripped(self):
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d])
        for spelling, canon in self.SPELLINGS.items():
            before_p, before_d = len(p.requests), len(d.requests)
            c = RawClient(px.port)
            try:
                c.request("POST", spelling, completion_body(kv_transfer_params=EVIL))
                r = c.read_response()
            finally:
                c.close()
            self.assertEqual(r.status, 200, "%s: %r" % (spelling, r.body[:300]))
            self.assertEqual(len(p.requests), before_p + 1, "%s: not disaggregated" % spelling)
            dr = d.requests[before_d]
            self.assertEqual(dr.path.split("?")[0], canon, spelling)
            for req in (p.requests[before_p], dr):
                self.assertFalse(has_evil(req), "%s: client kv_transfer_params reached %s"
                                 % (spelling, req.path))

    def test_bad_percent_encoding_refused(self):
        d = self.mock(decode_handler(), "d")
        px = self.start([], [d])
        for bad in ("/v1/chat%2", "/v1/chat%zzcompletions", "/v1/%"):
            c = RawClient(px.port)
            try:
                c.request("POST", bad, completion_body())
                r = c.read_response()
            finally:
                c.close()
            self.assertEqual(r.status, 400, bad)
            self.assertEqual(json.loads(r.body)["error"]["code"], 400)
        self.assertEqual(len(d.requests), 0)

    def test_other_escapes_kept_encoded(self):
        """Escapes of reserved characters stay escaped, so an engine that
        decodes once sees what the proxy routed on."""
        d = self.mock(decode_handler(), "d")
        px = self.start([], [d])
        c = RawClient(px.port)
        try:
            c.request("POST", "/v1/a%3fb%2563", {"x": 1})
            r = c.read_response()
        finally:
            c.close()
        self.assertEqual(r.status, 200)
        self.assertEqual(d.requests[-1].path, "/v1/a%3Fb%2563")


class EveryRouteStripsTest(ProdCase):
    """H1, defence in depth: the client's kv_transfer_params reaches no
    backend on any route, passthrough included."""

    ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
              "/v1/embeddings", "/tokenize", "/detokenize", "/pooling", "/v1/score",
              "/v1/audio/transcriptions", "/v1/chat/completions/render"]

    def test_every_route(self):
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d])
        for path in self.ROUTES:
            for body in (completion_body(kv_transfer_params=EVIL),
                         {"kv_transfer_\\u0070arams": 1, "model": "m", "prompt": "x"}):
                raw = json.dumps(body).replace("\\\\u", "\\u")
                r = http_request(px.port, "POST", path, raw)
                self.assertEqual(r.status, 200, "%s: %r" % (path, r.body[:300]))
        for req in p.requests + d.requests:
            self.assertFalse(has_evil(req), "kv_transfer_params reached %s" % req.path)
            if req.method == "POST" and req.body[:1] == b"{":
                doc = json.loads(req.body)
                kv = doc.get("kv_transfer_params")
                self.assertTrue(kv is None or kv.get("remote_request_id") != "evil", req.path)
                self.assertNotIn(1, [kv] if kv is not None else [], req.path)

    def test_non_json_passthrough_body_unchanged(self):
        d = self.mock(decode_handler(), "d")
        px = self.start([], [d])
        body = b"--b\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\nx\r\n--b--\r\n"
        r = http_request(px.port, "POST", "/v1/audio/transcriptions", body,
                         {"Content-Type": "multipart/form-data; boundary=b"})
        self.assertEqual(r.status, 200)
        self.assertEqual(d.requests[-1].body, body)
        self.assertEqual(d.requests[-1].header("content-type"), "multipart/form-data; boundary=b")


class ExtraResponseTest(ProdCase):
    """H2: a backend that sends one response more than asked for poisoned the
    keep-alive connection: later requests got another request's answer.
    Covered: a stray answer behind the real one (one write), with clients in
    sequence and concurrent, and one in a write of its own that arrives
    while the connection is idle. A stray answer that arrives after the
    next request was written on the connection cannot be told from that
    request's answer (HTTP/1.1 has no correlation): not tested."""

    N = 40

    @staticmethod
    def stray(status=200, body=b'{"stolen":true}'):
        return (b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % (status, len(body)) + body)

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.strays = threading.Semaphore(0)

    def answer_then_stray(self, req, status, body, stray):
        """Writes the answer and then, in a write of its own, a stray answer;
        then waits for pdproxy to close the connection (it must not send
        another request on it)."""
        head = b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" \
            % (status, len(body))
        req.conn.sock.sendall(head + body)
        req.conn.sock.sendall(stray)
        self.strays.release()
        return Hang(max_s=10.0)

    def decode_extra(self, mode):
        def h(req):
            rid = req.header("x-request-id") or ""
            body = json.dumps({"id": rid, "choices": [{"index": 0, "text": rid}]}).encode()
            if mode == "same":
                return Respond(200, [JSONCT, ("Content-Length", str(len(body)))],
                               body + self.stray(), raw_framing=True)
            return self.answer_then_stray(req, 200, body, self.stray())
        return h

    def prefill_extra(self, mode):
        base = prefill_handler()

        def h(req):
            a = base(req)
            evil = prefill_handler(kv=dict(EVIL, remote_host="127.0.0.1"))(req)
            extra = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(evil.body) + evil.body)
            if mode == "same":
                return Respond(200, [JSONCT, ("Content-Length", str(len(a.body)))],
                               a.body + extra, raw_framing=True)
            return self.answer_then_stray(req, 200, a.body, extra)
        return h

    def sequential(self, one, i, mode):
        """One request after the stray answer of the one before was sent."""
        res = one(i)
        if mode == "late":
            self.assertTrue(self.strays.acquire(timeout=10), "the mock sent no stray answer")
        return res

    def check_decode(self, mode, concurrent):
        d = self.mock(self.decode_extra(mode), "d")
        px = self.start([], [d])

        def one(i):
            rid = "req-%s-%d" % (mode, i)
            r = http_request(px.port, "POST", "/v1/embeddings", {"input": "x"},
                             {"X-Request-Id": rid})
            return r.status, r.body

        results = self.concurrent(one, self.N, workers=8) if concurrent else \
            [self.sequential(one, i, mode) for i in range(self.N)]
        bad = []
        for i, res in enumerate(results):
            self.assertNotIsInstance(res, Exception)
            st, body = res
            rid = "req-%s-%d" % (mode, i)
            if b"stolen" in body or (st == 200 and json.loads(body)["id"] != rid):
                bad.append(i)
        self.assertEqual(bad, [], "%d of %d requests got another answer" % (len(bad), self.N))

    def check_prefill(self, mode, concurrent):
        p = self.mock(self.prefill_extra(mode), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d])

        def one(i):
            r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                             {"X-Request-Id": "req-%s-%d" % (mode, i)})
            return r.status

        if concurrent:
            self.concurrent(one, self.N, workers=8)
        else:
            for i in range(self.N):
                self.sequential(one, i, mode)
        self.assertGreater(len(d.requests), 0)
        bad = []
        for req in d.requests:
            kv = json.loads(req.body).get("kv_transfer_params") or {}
            rid = req.header("x-request-id")
            if kv.get("remote_request_id") != "%s-a1b2c3" % rid:
                bad.append(rid)
        self.assertEqual(bad, [], "%d of %d decodes got another request's kv_transfer_params"
                         % (len(bad), len(d.requests)))

    def test_decode_same_segment_sequential(self):
        self.check_decode("same", False)

    def test_decode_late_sequential(self):
        self.check_decode("late", False)

    def test_decode_same_segment_concurrent(self):
        self.check_decode("same", True)

    def test_prefill_same_segment_sequential(self):
        self.check_prefill("same", False)

    def test_prefill_late_sequential(self):
        self.check_prefill("late", False)

    def test_prefill_same_segment_concurrent(self):
        self.check_prefill("same", True)


class HeaderAllowListTest(ProdCase):
    """M0: passthrough routes forwarded Cookie, X-Forwarded-For,
    x-prefiller-host-port, arbitrary X- headers and headers named in
    Connection."""

    ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/v1/messages"), ("POST", "/v1/responses"), ("GET", "/v1/responses/x"),
              ("POST", "/v1/embeddings"), ("POST", "/tokenize"), ("GET", "/v1/models"),
              ("DELETE", "/v1/files/x")]
    BAD = [("Cookie", "s=1"), ("X-Forwarded-For", "10.0.0.1"),
           ("x-prefiller-host-port", "169.254.169.254:80"), ("X-Evil", "1"),
           ("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"), ("Forwarded", "for=x"),
           ("Proxy-Authorization", "Basic x"), ("Accept-Encoding", "gzip")]

    def test_every_route(self):
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d])
        for method, path in self.ROUTES:
            body = completion_body() if method == "POST" else None
            c = RawClient(px.port)
            try:
                c.request(method, path, body, self.BAD + [("Accept", "application/json")])
                r = c.read_response(method=method)
            finally:
                c.close()
            self.assertEqual(r.status, 200, "%s %s: %r" % (method, path, r.body[:300]))
        self.assertGreater(len(d.requests), len(self.ROUTES) - 1)
        for req in p.requests + d.requests:
            names = {k.lower() for k, _ in req.headers}
            for k, _ in self.BAD:
                if k.lower() == "connection":
                    continue
                self.assertNotIn(k.lower(), names, "%s %s" % (req.method, req.path))
            self.assertEqual(req.header("x-prefiller-host-port"), None)


class SelfLoopTest(AdminCase):
    """M1/M5: a backend that is the proxy itself was accepted, and each
    request looped until its total timeout (2,040 requests in flight)."""

    def test_own_address_refused_at_start(self):
        port = free_port()
        for spelling in ("http://127.0.0.1:%d", "http://localhost:%d", "http://127.0.0.1:%d/",
                         "http://[::ffff:127.0.0.1]:%d", "http://0.0.0.0:%d"):
            for role in ("--prefill", "--decode"):
                p = run_pdproxy(["--host", "0.0.0.0", "--port", str(port), role,
                                 spelling % port])
                self.assertEqual(p.returncode, 2, (spelling, role, p.stderr))
                self.assertIn("this proxy's own listen address", p.stderr)

    def test_own_address_refused_by_reload_and_admin(self):
        P = self.mock(prefill_handler(), "p")
        D = self.mock(decode_handler(), "d")
        px = self.start_admin(pools_yaml([("m", ["m"], [P], [D])]))
        me = "http://%s:%d" % (HOST, px.port)
        st, doc = self.call("POST", "/admin/backends", {"role": "prefill", "url": me, "pool": "m"})
        self.assertEqual(st, 400, doc)
        self.assertIn("own listen address", doc["error"]["message"])
        write_yaml(self.file, pools_yaml([("m", ["m"], [P, me], [D])]))
        st, doc = self.call("POST", "/admin/reload")
        self.assertEqual(st, 400, doc)
        self.assertIn("own listen address", doc["error"]["message"])
        self.assertEqual(self.post(px, completion_body(model="m")).status, 200)
        self.assertEqual(len(P.requests), 1)

    def test_loop_through_another_proxy_gets_508(self):
        pa, pb = free_port(), free_port()
        procs = []
        for me, other in ((pa, pb), (pb, pa)):
            p = Proxy(["--host", HOST, "--port", str(me), "--threads", "2",
                       "--health-interval", "0", "--decode", "http://%s:%d" % (HOST, other),
                       "--prefill", "http://%s:%d" % (HOST, other)], port=me)
            p.spawn()
            self.track_proxy(p)
            procs.append(p)
        for p in procs:
            p.wait_ready()
        t0 = time.monotonic()
        r = http_request(pa, "POST", "/v1/embeddings", {"input": "x"}, timeout=20)
        self.assertEqual(r.status, 508, r.body)
        self.assertEqual(json.loads(r.body)["error"]["code"], 508)
        r = http_request(pa, "POST", "/v1/completions", completion_body(), timeout=20)
        self.assertEqual(r.status, 508, r.body)
        self.assertLess(time.monotonic() - t0, 10)

    def test_via_sent_upstream(self):
        d = self.mock(decode_handler(), "d")
        px = self.start([], [d])
        r = http_request(px.port, "POST", "/v1/embeddings", {"input": "x"},
                         {"Via": "1.1 front"})
        self.assertEqual(r.status, 200)
        via = d.requests[-1].header("via")
        self.assertTrue(via.startswith("1.1 front, 1.1 pdproxy-"), via)


class EmptyPoolReloadTest(AdminCase):
    """M2: an empty or comment-only file was accepted on reload and fell
    back to the toy defaults (localhost:8100/8200): every request a 502."""

    def test_empty_and_comment_only_reload_refused(self):
        P = self.mock(prefill_handler(), "p")
        D = self.mock(decode_handler(), "d")
        px = self.start_admin(pools_yaml([("m", ["m"], [P], [D])]))
        for text in ("", "# nothing here\n", "pools:\n  - name: m\n    models: [m]\n"
                     "    prefill: []\n    decode: [%s]\n" % url(D),
                     "prefill: [%s]\n" % url(P)):
            write_yaml(self.file, text)
            st, doc = self.call("POST", "/admin/reload")
            self.assertEqual(st, 400, (text, doc))
            self.assertIn("no ", doc["error"]["message"])
            self.assertEqual(self.post(px, completion_body(model="m")).status, 200, text)
        st, doc = self.call("DELETE", "/admin/backends", {"role": "decode", "url": url(D),
                                                          "pool": "m"})
        self.assertEqual(st, 400, doc)
        self.assertEqual(self.post(px, completion_body(model="m")).status, 200)

    def test_allow_empty_pools_setting(self):
        P = self.mock(prefill_handler(), "p")
        D = self.mock(decode_handler(), "d")
        px = self.start_admin(pools_yaml([("m", ["m"], [P], [D])]), extra=["--allow-empty-pools"])
        write_yaml(self.file, "# emptied on purpose\n")
        st, doc = self.call("POST", "/admin/reload")
        self.assertEqual(st, 200, doc)
        r = self.post(px, completion_body(model="m"))
        self.assertEqual(r.status, 503, r.body)

    def test_no_toy_default_behind_a_file(self):
        D = self.mock(decode_handler(), "d")
        d = tmpdir(self)
        f = os.path.join(d, "c.yaml")
        write_yaml(f, "decode: [%s]\n" % url(D))
        px = self.start(args=["--config", f])
        r = http_request(px.port, "GET", "/ready")
        self.assertEqual(r.status, 503)
        doc = json.loads(bytes(r.body))
        self.assertEqual(doc["pools"][0]["missing"], ["prefill"], doc)
        self.assertEqual(doc["pools"][0]["prefill"]["total"], 0, doc)

class ConfigCostTest(AdminCase):
    """M4: a 100k-deep flow nesting took ~20 s and 42 MiB to refuse; a FIFO
    as the config path blocked forever."""

    def run_with(self, text=None, fifo=False):
        f = os.path.join(self.dir, "x.yaml")
        if fifo:
            os.mkfifo(f)
        else:
            with open(f, "w") as fh:
                fh.write(text)
        t0 = time.monotonic()
        p = run_pdproxy(["--config", f, "--port", str(free_port())], timeout=10)
        return p, time.monotonic() - t0

    def test_deep_nesting_refused_fast(self):
        for text in ("prefill: " + "[" * 100000, "a:\n" + "".join(
                "%s- x:\n" % ("  " * i) for i in range(40))):
            p, took = self.run_with(text)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("nested deeper than 16 levels", p.stderr)
            self.assertLess(took, 3)

    def test_large_file_refused(self):
        p, took = self.run_with("#" * (16 * 1024 * 1024 + 1))
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("larger than", p.stderr)

    def test_fifo_refused(self):
        p, took = self.run_with(fifo=True)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("not a regular file", p.stderr)

    def test_deep_reload_refused_running_config_stays(self):
        P = self.mock(prefill_handler(), "p")
        D = self.mock(decode_handler(), "d")
        px = self.start_admin(pools_yaml([("m", ["m"], [P], [D])]))
        write_yaml(self.file, "pools: " + "[" * 100000)
        st, doc = self.call("POST", "/admin/reload")
        self.assertEqual(st, 400, doc)
        self.assertIn("nested deeper", doc["error"]["message"])
        self.assertEqual(self.post(px, completion_body(model="m")).status, 200)


class EstimateTest(ProdCase):
    """M6: "hi" plus 200 KB of tools was estimated at 8 tokens and sent to
    decode alone, which then ran the long prefill."""

    def test_rendered_members_counted(self):
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d], extra=["--disagg-min-tokens", "1000"])
        tool = {"type": "function", "function": {"name": "f", "description": "x" * 2000,
                                                 "parameters": {"type": "object"}}}
        big = "y" * 20000
        cases = [("/v1/chat/completions", chat_body(tools=[tool] * 100)),
                 ("/v1/chat/completions", chat_body(functions=[tool["function"]] * 100)),
                 ("/v1/chat/completions", chat_body(documents=[{"text": big}])),
                 ("/v1/chat/completions", chat_body(chat_template=big)),
                 ("/v1/messages", chat_body(tools=[tool] * 100)),
                 ("/v1/completions", completion_body(prompt="", prompt_embeds=big))]
        for path, body in cases:
            before = len(p.requests)
            r = http_request(px.port, "POST", path, body)
            self.assertEqual(r.status, 200, (path, r.body))
            self.assertEqual(len(p.requests), before + 1,
                             "%s %s: sent to decode alone" % (path, sorted(body)))
        # A short prompt alone still goes to decode alone.
        before = len(p.requests)
        self.assertEqual(http_request(px.port, "POST", "/v1/chat/completions",
                                      chat_body()).status, 200)
        self.assertEqual(len(p.requests), before)


class BrokenHeadTest(ProdCase):
    """Low: bare-LF heads and 101 answers waited for the whole idle timeout
    instead of failing fast; an endless stream of 1xx used a core until the
    idle timeout."""

    def raw_then_hang(self, raw):
        def h(req):
            try:
                req.conn.sock.sendall(raw)
            except OSError:
                pass
            return Hang(max_s=10.0)
        return h

    def test_fail_fast(self):
        cases = {
            "101": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
            "bare LF": b"HTTP/1.1 200 OK\nContent-Type: application/json\nContent-Length: 2\n\n{}",
            "endless 1xx": b"HTTP/1.1 100 Continue\r\n\r\n" * 20000,
        }
        for name, raw in cases.items():
            d = self.mock(self.raw_then_hang(raw), "d-" + name.replace(" ", ""))
            px = self.start([], [d], extra=["--decode-idle-timeout", "30"])
            t0 = time.monotonic()
            r = http_request(px.port, "POST", "/v1/embeddings", {"input": "x"}, timeout=20)
            took = time.monotonic() - t0
            self.assertEqual(r.status, 502, (name, r.body))
            self.assertLess(took, 3, name)


class AdminTokenTest(AdminCase):
    """Low: the admin token was truncated past 1023 bytes, NUL bytes and
    /dev/zero were accepted as tokens, refused calls logged without a rate
    limit."""

    def refused_start(self, path):
        p = run_pdproxy(["--port", str(free_port()), "--admin-port", str(free_port()),
                         "--admin-token-file", path, "--decode", "http://127.0.0.1:9"])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("--admin-token-file", p.stderr)

    def test_bad_tokens_refused(self):
        for i, data in enumerate((b"a" * 1100, b"abcdefgh\x00ijklmnopq", b"abcdefghijklmno\x7f")):
            f = os.path.join(self.dir, "t%d" % i)
            with open(f, "wb") as fh:
                fh.write(data)
            self.refused_start(f)
        self.refused_start("/dev/zero")

    def test_refused_calls_logged_with_a_rate_limit(self):
        P = self.mock(prefill_handler(), "p")
        D = self.mock(decode_handler(), "d")
        px = self.start_admin(pools_yaml([("m", ["m"], [P], [D])]))
        for _ in range(200):
            st, _ = admin(self.aport, "GET", "/admin/backends", None, "wrong-token-wrong")
            self.assertEqual(st, 401)
        n = px.stderr().count("admin call refused")
        self.assertGreaterEqual(n, 1)
        self.assertLess(n, 20, "every refused call logged")


class AdminSpellingTest(AdminCase):
    """Low: the admin API added one backend under several spellings
    (trailing '/', localhost, 127.1); {"pool":5} silently meant the unnamed
    pool."""

    def test_one_backend_one_spelling(self):
        P = self.mock(prefill_handler(), "p")
        D = self.mock(decode_handler(), "d")
        px = self.start_admin(pools_yaml([("m", ["m"], [P], [D])]))
        for u in ("http://127.0.0.1:%d/" % P.port, "http://127.1:%d" % P.port,
                  "http://localhost:%d" % P.port, "HTTP://127.0.0.1:%d" % P.port,
                  "http://[::ffff:127.0.0.1]:%d" % P.port):
            st, doc = self.call("POST", "/admin/backends", {"role": "prefill", "url": u,
                                                            "pool": "m"})
            self.assertIn(st, (400, 409), (u, doc))
        st, doc = self.call("GET", "/admin/backends")
        self.assertEqual(len([b for b in doc["backends"] if b["role"] == "prefill"]), 1, doc)
        for bad in (5, None, ["m"], {"x": 1}):
            st, doc = self.call("POST", "/admin/backends", {"role": "prefill", "pool": bad,
                                                            "url": "http://127.0.0.1:9"})
            self.assertEqual(st, 400, (bad, doc))
        self.assertEqual(self.post(px, completion_body(model="m")).status, 200)


class MisleadingAnswersTest(AdminCase):
    """Low: status 600/999 relayed; HEAD on /v1/models with named pools got
    405; sidecar mode health-checked a toy default prefill nobody set."""

    def test_status_beyond_599_is_502(self):
        for st in (600, 999):
            d = self.mock(lambda req, st=st: Respond(st, [JSONCT], b"{}"), "d%d" % st)
            px = self.start([], [d])
            r = http_request(px.port, "POST", "/v1/embeddings", {"input": "x"})
            self.assertEqual(r.status, 502, (st, r.body))

    def test_head_models_with_named_pools(self):
        P = self.mock(prefill_handler(), "p")
        D = self.mock(decode_handler(), "d")
        px = self.start_admin(pools_yaml([("m", ["m"], [P], [D])]))
        r = http_request(px.port, "HEAD", "/v1/models")
        self.assertEqual(r.status, 200)
        self.assertEqual(r.body, b"")

    def test_sidecar_checks_no_toy_prefill(self):
        D = self.mock(decode_handler(), "d")
        px = self.start(args=["--prefiller-from-header", "--prefiller-allowlist", "127.0.0.1:*",
                              "--decode", url(D)])
        r = http_request(px.port, "GET", "/healthcheck")
        self.assertEqual(json.loads(r.body)["prefill_instances"], 0, r.body)


class HonestMessagesTest(AdminCase):
    """Low: a 512+ byte model name got "names no model"; a drained prefill
    was reported as "ejected"; with one prefill, "retrying on another
    instance" resent to the same one."""

    def test_long_model_name(self):
        P = self.mock(prefill_handler(), "p")
        D = self.mock(decode_handler(), "d")
        px = self.start_admin(pools_yaml([("m", ["m"], [P], [D])]))
        r = self.post(px, completion_body(model="x" * 600))
        self.assertIn(r.status, (400, 404))
        msg = json.loads(r.body)["error"]["message"]
        self.assertNotIn("names no model", msg)
        self.assertIn("longer than", msg)

    def test_drained_prefill_not_called_ejected(self):
        P = self.mock(prefill_handler(), "p")
        D = self.mock(decode_handler(), "d")
        px = self.start_admin(pools_yaml([("m", ["m"], [P], [D])]))
        st, doc = self.call("POST", "/admin/backends/drain", {"url": url(P), "role": "prefill",
                                                              "pool": "m"})
        self.assertEqual(st, 200, doc)
        r = self.post(px, completion_body(model="m"))
        self.assertEqual(r.status, 503, r.body)
        msg = json.loads(r.body)["error"]["message"]
        self.assertIn("drained", msg)

    def test_one_prefill_retry_message(self):
        P = self.mock(lambda req: Respond(500, [JSONCT], b"{}"), "p")
        D = self.mock(decode_handler(), "d")
        px = self.start([P], [D])
        r = self.post(px, completion_body())
        self.assertEqual(r.status, 502)
        self.assertIn("prefill failed, retrying", px.stderr())
        self.assertNotIn("another instance", px.stderr())


class OtlpExitTest(ProdCase):
    """Low: with a black-hole OTLP collector exit took twice the export
    timeout (README: at most the export timeout)."""

    def test_exit_within_export_timeout(self):
        col = self.mock(lambda req: Hang(max_s=30.0), "collector")
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d], env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://%s:%d" % (HOST, col.port),
            "OTEL_EXPORTER_OTLP_TIMEOUT": "2000", "OTEL_BSP_SCHEDULE_DELAY": "10",
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"})
        for _ in range(3):
            self.assertEqual(self.post(px).status, 200)
        col.wait_requests(1, timeout=5)  # an export is in flight, hanging
        t0 = time.monotonic()
        px._expected_exit = True
        px.proc.send_signal(signal.SIGTERM)
        px.proc.wait(30)
        self.assertLess(time.monotonic() - t0, 3.0, "exit waited past the export timeout")


if __name__ == "__main__":
    main()
