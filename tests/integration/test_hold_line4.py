#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 41, "hold the line, fourth round": one test class per observation.

H1. A '#fragment' in the request target is refused (400): an engine behind
    (uvicorn with httptools) drops it and serves the P/D route the proxy
    took for a passthrough. A body that begins with a byte-order mark or is
    UTF-16/UTF-32 is refused on every route: Python's json.loads decodes it,
    the proxy cannot look inside it to strip its kv_transfer_params.
H2. kv_transfer_params nested where vLLM reads them too never reach an
    engine: a generate request's sampling_params.extra_args, and vllm_xargs
    (merged into extra_args) on every route.
H3. A request's tenant comes from its credentials: an API key of
    --tenant-keys, or the tenant header from a trusted gateway
    (--tenant-header-from) and refused from anyone else; unknown callers
    are the default tenant, with limits of its own.
H4. Engines get a cache_salt per tenant (or per key): a client's own salt
    only splits its tenant's share; the KV index keys blocks by it, so
    kv_aware finds each tenant's blocks and no one else's.
M6. The tokens-per-minute limit holds: streams ask decode for their usage
    (the usage chunk is dropped before a client that did not ask, every
    other byte as it came), a request reserves its max_tokens at admission
    and settles on its usage, clamped to what it could have produced.
M5. Who may claim which priority class is the tenant's configuration
    (floor=P); classes may get shares instead of strict order, so a lower
    class is never starved.
L.  Malformed KV-event batches are logged at most once a second;
    x-queue-timeout: 0 means "do not wait", not "the queue is full"; the
    admin admission API refuses "a\\u0000b" and repeated settings, and says
    which member is wrong.
M7. A late extra answer never reaches the wrong request: an answer echoing
    another X-Request-Id, or a prefill answer whose remote_request_id is
    another request's, is refused and counted; a connection on which an
    answer began before the request was written is not reused."""

import http.client
import json
import os
import socket
import threading
import time

from pdharness.case import main
from pdharness.client import RawClient, http_request
from pdharness.ctl import tmpdir
from pdharness.kvpub import Publisher
from pdharness.mocks import HostMock, Respond, Stream, decode_handler, prefill_handler
from pdharness.net import HOST, MAX_LOOP, Listener, free_port, wait_value
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom
from test_kv_events import BS, port_free_on, tokens
from test_pd_generate import gen_decode, gen_prefill

EVIL = {"do_remote_prefill": True, "remote_host": "169.254.169.254", "remote_port": 80,
        "remote_engine_id": "evil", "remote_block_ids": [1], "remote_request_id": "evil"}


def has_evil(req):
    return b"169.254.169.254" in req.body


def assert_openai_400(case, r, what):
    case.assertEqual(r.status, 400, "%s: %r" % (what, r.body[:200]))
    err = json.loads(r.body)["error"]
    case.assertEqual(err["code"], 400, what)
    case.assertTrue(err["message"], what)


class FragmentTest(ProdCase):
    """H1: POST /v1/chat/completions#frag went to the passthrough with the
    client's kv_transfer_params, skipping prefill, admission and limits."""

    def test_fragment_refused_on_every_route(self):
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d])
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                           "kv_transfer_params": EVIL})
        for target in ("/v1/chat/completions#frag", "/v1/completions#", "/v1/embeddings#x",
                       "/v1/chat/completions?a=1#b", "http://h/v1/chat/completions#f"):
            c = RawClient(px.port)
            try:
                c.request("POST", target, body)
                r = c.read_response()
            finally:
                c.close()
            assert_openai_400(self, r, target)
            self.assertIn(b"fragment", r.body, target)
        self.assertEqual(len(p.requests) + len(d.requests), 0)


class ForeignEncodingTest(ProdCase):
    """H1: a body starting EF BB BF (or UTF-16/32, with or without BOM) was
    forwarded unchanged by the passthrough, and json.loads in the engine
    read the client's kv_transfer_params out of it."""

    def test_bom_and_utf16_32_refused(self):
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d])
        doc = json.dumps({"model": "m", "prompt": "x", "input": "x",
                          "kv_transfer_params": EVIL})
        bodies = {"utf-8 bom": b"\xef\xbb\xbf" + doc.encode(),
                  "utf-16": doc.encode("utf-16"), "utf-16-le": doc.encode("utf-16-le"),
                  "utf-16-be": doc.encode("utf-16-be"), "utf-32": doc.encode("utf-32"),
                  "utf-32-le": doc.encode("utf-32-le"), "utf-32-be": doc.encode("utf-32-be")}
        for path in ("/v1/embeddings", "/v1/score", "/v1/chat/completions", "/v1/completions",
                     "/v1/responses"):
            for name, raw in bodies.items():
                # What an engine would read: json.loads accepts each one.
                self.assertEqual(json.loads(raw)["kv_transfer_params"], EVIL)
                r = http_request(px.port, "POST", path, raw,
                                 {"Content-Type": "application/json"})
                assert_openai_400(self, r, "%s %s" % (path, name))
        for req in p.requests + d.requests:
            self.assertFalse(has_evil(req), req.path)
        self.assertEqual(len(p.requests) + len(d.requests), 0)

    def test_plain_utf8_still_served(self):
        d = self.mock(decode_handler(), "d")
        px = self.start([], [d])
        r = http_request(px.port, "POST", "/v1/embeddings", {"input": "h\u00e9", "model": "m"})
        self.assertEqual(r.status, 200)


class NestedParamsTest(ProdCase):
    """H2: /inference/v1/generate forwarded sampling_params.extra_args.
    kv_transfer_params to both engines; vllm_xargs.kv_transfer_params is
    merged into the same extra_args by vLLM's OpenAI routes."""

    def test_generate_extra_args(self):
        p = self.mock(gen_prefill, "p")
        d = self.mock(gen_decode, "d")
        px = self.start([p], [d])
        body = {"model": "m", "token_ids": [1, 2, 3],
                "sampling_params": {"max_tokens": 5, "temperature": 0,
                                    "extra_args": {"kv_transfer_params": EVIL, "keep": 1}}}
        r = http_request(px.port, "POST", "/inference/v1/generate", body)
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(p.requests), 1)
        self.assertEqual(len(d.requests), 1)
        for req in (p.requests[0], d.requests[0]):
            self.assertFalse(has_evil(req), req.path)
            self.assertEqual(req.json()["sampling_params"]["extra_args"], {"keep": 1})
        # Decode still gets prefill's own parameters, at the top level.
        kv = d.requests[0].json()["kv_transfer_params"]
        self.assertEqual(kv["remote_host"], "127.0.0.1")
        self.assertNotEqual(kv.get("remote_request_id"), "evil")

    def test_vllm_xargs_on_every_route(self):
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d])
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses",
                     "/v1/embeddings", "/tokenize"):
            body = {"model": "m", "prompt": "x", "input": "x",
                    "messages": [{"role": "user", "content": "x"}],
                    "vllm_xargs": {"kv_transfer_params": json.dumps(EVIL), "k": 2}}
            r = http_request(px.port, "POST", path, body)
            self.assertEqual(r.status, 200, "%s: %r" % (path, r.body[:200]))
        for req in p.requests + d.requests:
            self.assertFalse(has_evil(req), req.path)
            self.assertEqual(req.json()["vllm_xargs"], {"k": 2}, req.path)


KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-9876543210",
        "bob2": "sk-bob-second-key-42"}


def keyfile(case):
    d = tmpdir(case)
    path = os.path.join(d, "tenant-keys")
    with open(path, "w") as f:
        f.write("# TENANT:KEY\nalice:%s\nbob: %s\nbob:%s\n"
                % (KEYS["alice"], KEYS["bob"], KEYS["bob2"]))
    return path


def auth(who, **extra):
    h = {"Authorization": "Bearer " + KEYS[who]} if who else {}
    h.update(extra)
    return h


def post_from(port, source, body, headers):
    """A POST from the loopback address `source` (a gateway or not)."""
    c = http.client.HTTPConnection(HOST, port, timeout=10, source_address=(source, 0))
    try:
        hs = {"Content-Type": "application/json"}
        hs.update(headers)
        c.request("POST", "/v1/completions", body=json.dumps(body), headers=hs)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


class TenantCredentialsTest(ProdCase):
    """H3: x-tenant was believed from anyone: leaving it out, or a name
    unknown or differently cased, meant no limits; naming another tenant
    spent its budget."""

    def proxy(self, extra=()):
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        return self.start([p], [d], ["--tenant", "alice:rpm=2 bob:rpm=100 default:rpm=1",
                                     "--tenant-keys", keyfile(self)] + list(extra))

    def post(self, px, headers):
        return http_request(px.port, "POST", "/v1/completions",
                            {"model": "m", "prompt": "x", "max_tokens": 2}, headers)

    def test_key_decides_not_the_header(self):
        px = self.proxy()
        # bob names alice in the header: bob's own budget is spent, not hers.
        for i in range(5):
            r = self.post(px, auth("bob", **{"x-tenant": "alice"}))
            self.assertEqual(r.status, 200, "bob's request %d: %r" % (i, r.body[:200]))
        for i in range(2):
            self.assertEqual(self.post(px, auth("alice")).status, 200, "alice %d" % i)
        r = self.post(px, auth("alice"))
        self.assertErrorJson(r, 429, "alice's third in a minute")
        self.assertIn(b"alice", r.body)
        # Callers without a key are the default tenant, limited (rpm=1)
        # whatever tenant they name, in whatever case.
        self.assertEqual(self.post(px, {}).status, 200)
        for h in ({}, {"x-tenant": "bob"}, {"x-tenant": "ALICE"}, {"x-tenant": "nobody"}):
            self.assertErrorJson(self.post(px, h), 429, "default tenant, %r" % h)
        # Keys are never written to the log, whatever the level.
        text = px.stderr()
        for k in KEYS.values():
            self.assertNotIn(k, text)

    def test_api_keys_still_required(self):
        """With --api-key, tenant keys are accepted keys; others get 401."""
        px = self.proxy(["--api-key", "sk-plain-key-55"])
        self.assertEqual(self.post(px, auth("alice")).status, 200)
        self.assertEqual(self.post(px, {"Authorization": "Bearer sk-plain-key-55"}).status, 200)
        self.assertErrorJson(self.post(px, {"Authorization": "Bearer sk-wrong"}), 401)
        self.assertErrorJson(self.post(px, {}), 401)

    def test_gateway_header_trusted_only_from_gateway(self):
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d], ["--tenant", "alice:rpm=2 default:rpm=50",
                                   "--tenant-header-from", "127.0.0.2/32"])
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        # From anyone else, a request naming a tenant is refused.
        st, b = post_from(px.port, "127.0.0.1", body, {"x-tenant": "alice"})
        self.assertEqual(st, 403, b)
        self.assertIn(b"--tenant-header-from", b)
        # From the gateway, the header names the tenant: alice's limit holds.
        for i in range(2):
            st, b = post_from(px.port, "127.0.0.2", body, {"x-tenant": "alice"})
            self.assertEqual(st, 200, b)
        st, b = post_from(px.port, "127.0.0.2", body, {"x-tenant": "alice"})
        self.assertEqual(st, 429, b)
        # Without the header: the default tenant, from anywhere.
        st, b = post_from(px.port, "127.0.0.1", body, {})
        self.assertEqual(st, 200, b)
        self.assertEqual(metric(prom(px.port), "pdproxy_admission_total",
                                event="tenant_header_refused"), 1)

    def test_key_file_errors_at_start(self):
        from pdharness.procs import run_pdproxy
        d = tmpdir(self)
        path = os.path.join(d, "bad")
        with open(path, "w") as f:
            f.write("alice:secret-one\nno-tenant-secret-two\n")
        p = run_pdproxy(["--decode", "http://127.0.0.1:9", "--tenant-keys", path])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("line 2", p.stderr)
        self.assertNotIn("secret", p.stderr)


def salt_of(req):
    return req.json().get("cache_salt")


class CacheSaltTest(ProdCase):
    """H4: prefix caches leaked across tenants by timing; pdproxy sent no
    cache_salt, or the client's own."""

    def run_case(self, mode):
        p = self.mock(prefill_handler(), "p")
        d = self.mock(decode_handler(), "d")
        px = self.start([p], [d], ["--tenant", "alice bob", "--tenant-keys", keyfile(self),
                                   "--cache-salt", mode])
        sent = [("alice", None), ("alice", None), ("bob", None), ("bob2", None), (None, None),
                ("alice", "mine"), ("bob", "mine")]
        for who, own in sent:
            body = {"model": "m", "prompt": "same prompt", "max_tokens": 2}
            if own:
                body["cache_salt"] = own
            r = http_request(px.port, "POST", "/v1/completions", body, auth(who))
            self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(p.requests), len(sent))
        salts = []
        for pr, dr in zip(p.requests, d.requests):
            # Prefill and decode of one request: the same salt, once.
            self.assertEqual(salt_of(pr), salt_of(dr))
            self.assertEqual(pr.body.count(b"cache_salt"), 1 if salt_of(pr) else 0)
            salts.append(salt_of(pr))
        return salts

    def test_salt_per_tenant(self):
        a1, a2, b, b2, anon, a_own, b_own = self.run_case("tenant")
        self.assertEqual(a1, a2)
        self.assertEqual(b, b2, "two keys of one tenant share its salt")
        self.assertEqual(len({a1, b, anon, a_own, b_own}), 5)
        for s in (a1, b, anon, a_own, b_own):
            self.assertRegex(s, "^[0-9a-f]{32}$")
        self.assertNotIn("mine", (a_own, b_own))

    def test_salt_per_key(self):
        a1, a2, b, b2, anon, a_own, b_own = self.run_case("key")
        self.assertEqual(a1, a2)
        self.assertNotEqual(b, b2, "each key its own salt")
        self.assertEqual(len({a1, b, b2, anon, a_own, b_own}), 6)

    def test_salt_off_passes_the_clients(self):
        a1, a2, b, b2, anon, a_own, b_own = self.run_case("off")
        self.assertEqual([a1, a2, b, b2, anon], [None] * 5)
        self.assertEqual([a_own, b_own], ["mine", "mine"])


class SaltedIndexTest(ProdCase):
    """H4: the KV index must key blocks by the salt, or kv_aware would send a
    tenant to blocks it cannot use (another tenant's, or unsalted ones)."""

    def test_kv_aware_finds_the_tenants_own_blocks(self):
        hosts = ("127.0.0.2", "127.0.0.3")
        for _ in range(20):
            kvport = free_port()
            if port_free_on(hosts, kvport):
                break
        mocks, pubs = [], []
        for i, h in enumerate(hosts):
            m = HostMock(prefill_handler(), name="P%d" % i, host=h)
            self._mocks.append(m)
            self.addCleanup(self._stop_mock, m)
            pub = Publisher(h, kvport)
            self.addCleanup(pub.close)
            mocks.append(m)
            pubs.append(pub)
        D = self.mock(decode_handler(), "d")
        px = self.start(prefill=[(m.bind_host, m.port) for m in mocks], decode=[D],
                        extra=["--kv-events-port", str(kvport), "--prefill-policy", "kv_aware",
                               "--tenant", "alice bob", "--tenant-keys", keyfile(self)])
        for pub in pubs:
            pub.wait_subscriber()
        # Learn alice's salt from what an engine receives.
        r = http_request(px.port, "POST", "/v1/completions",
                         {"model": "m", "prompt": tokens(9, 2), "max_tokens": 2}, auth("alice"))
        self.assertEqual(r.status, 200, r.body)
        salt = salt_of((mocks[0].requests + mocks[1].requests)[0])
        self.assertTrue(salt)
        # Four prompts, each held by one engine under alice's salt (vLLM
        # puts it in the first block's extra keys only) and by the other
        # unsalted: alice's requests must find the salted copy every time,
        # which a tie-break would do one time in 16.
        prompts = [tokens(10 + k, 8) for k in range(4)]
        for k, toks in enumerate(prompts):
            salted, plain = pubs[k % 2], pubs[1 - k % 2]
            salted.publish([("BlockStored", [list(range(1000 * k, 1000 * k + 8)), None, toks, BS,
                                             None, "GPU", None, [[salt]] + [None] * 7])])
            plain.publish([("BlockStored", [list(range(1000 * k + 500, 1000 * k + 508)), None,
                                            toks, BS, None, "GPU", None, None])])
        for m in mocks:
            got = wait_value(lambda: metric(prom(px.port), "pdproxy_kv_index_blocks",
                                            backend=self.bname(m)), lambda v: v == 32, 10.0)
            self.assertEqual(got, 32)
        for k, toks in enumerate(prompts):
            for m in mocks:
                m.requests.clear()
            body = {"model": "m", "prompt": toks + [7, 7], "max_tokens": 2}
            self.assertEqual(http_request(px.port, "POST", "/v1/completions", body,
                                          auth("alice")).status, 200)
            self.assertEqual([len(m.requests) for m in mocks], [1 - k % 2, k % 2],
                             "prompt %d: alice's goes where her salted blocks are" % k)
        # bob's and an anonymous caller's salts are neither alice's nor none.
        for m in mocks:
            m.requests.clear()
        for who in ("bob", None):
            self.assertEqual(http_request(px.port, "POST", "/v1/completions",
                                          {"model": "m", "prompt": prompts[0], "max_tokens": 2},
                                          auth(who)).status, 200)
        got = [salt_of(r) for m in mocks for r in m.requests]
        self.assertEqual(len(got), 2)
        self.assertNotIn(salt, got)
        self.assertNotIn(None, got)


def usage_decode(total=10, gate=None):
    """A decode that answers like vLLM: a stream ends with a usage chunk
    only when stream_options.include_usage asks for it; `gate` (an Event)
    holds every answer until set."""
    base = {"id": "cmpl-u", "object": "text_completion", "created": 1, "model": "m"}
    usage = {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": total}

    def h(req):
        if gate is not None:
            gate.wait(20)
        doc = req.json()
        if not doc.get("stream"):
            body = dict(base, choices=[{"index": 0, "text": "ab", "finish_reason": "length"}],
                        usage=usage)
            return Respond(200, [("Content-Type", "application/json")], json.dumps(body))
        return Stream(200, [("Content-Type", "text/event-stream")],
                      [(0, c) for c in sse_answer(doc.get("stream_options") or {}, usage)])
    return h


def sse_answer(stream_options, usage):
    base = {"id": "cmpl-u", "object": "text_completion", "created": 1, "model": "m"}
    out = [b"data: " + json.dumps(dict(base, choices=[{"index": 0, "text": t,
                                                       "finish_reason": None}])).encode() + b"\n\n"
           for t in ("a", "b")]
    if stream_options.get("include_usage"):
        out.append(b"data: " + json.dumps(dict(base, choices=[], usage=usage)).encode() + b"\n\n")
    return out + [b"data: [DONE]\n\n"]


class TokenLimitTest(ProdCase):
    """M6: streams without include_usage were never counted (20 of 20 passed
    a limit of 30); concurrent requests each passed while the bucket was not
    empty; one answer's total_tokens of 999999999999999999 locked a tenant
    out (Retry-After: 9545387811)."""

    def proxy(self, tpm, decode):
        p = self.mock(prefill_handler(), "p")
        self.D = self.mock(decode, "d")
        return self.start([p], [self.D], ["--tenant", "alice:tpm=%d" % tpm,
                                           "--tenant-keys", keyfile(self)])

    def test_streams_are_counted_and_the_usage_chunk_dropped(self):
        px = self.proxy(30, usage_decode(total=10))
        want = b"".join(sse_answer({}, None))
        codes = []
        for i in range(20):
            c = RawClient(px.port)
            try:
                c.request("POST", "/v1/completions", json.dumps(
                    {"model": "m", "prompt": "x", "max_tokens": 2, "stream": True}),
                    [("Authorization", "Bearer " + KEYS["alice"]),
                     ("Content-Type", "application/json")])
                r = c.read_response()
            finally:
                c.close()
            codes.append(r.status)
            if r.status == 200:
                self.assertEqual(bytes(r.body), want, "stream %d, byte for byte" % i)
        self.assertEqual(codes.count(200), 3, "30 tokens a minute, 10 an answer: %r" % codes)
        so = self.D.requests[0].json()["stream_options"]
        self.assertEqual(so, {"include_usage": True})
        # A client that asks for the usage gets it, as decode sent it.
        px2 = self.proxy(1000, usage_decode(total=10))
        r = http_request(px2.port, "POST", "/v1/completions",
                         {"model": "m", "prompt": "x", "max_tokens": 2, "stream": True,
                          "stream_options": {"include_usage": True}}, auth("alice"))
        usage = {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
        self.assertEqual(r.body, b"".join(sse_answer({"include_usage": True}, usage)))

    def test_concurrent_requests_reserve_their_max_tokens(self):
        gate = threading.Event()
        self.addCleanup(gate.set)
        px = self.proxy(30, usage_decode(total=8, gate=gate))
        results = []

        def one(i):
            r = http_request(px.port, "POST", "/v1/completions",
                             {"model": "m", "prompt": "x", "max_tokens": 8}, auth("alice"),
                             timeout=30)
            results.append(r.status)
            return r.status

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        got = wait_value(lambda: len(results), lambda n: n >= 5, 10.0)
        self.assertGreaterEqual(got, 5, "refusals come at once")
        gate.set()
        for t in threads:
            t.join(30)
        self.assertEqual(sorted(results), [200] * 3 + [429] * 5,
                         "8 tokens reserved each against 30 a minute")

    def test_too_large_said_so_and_default_capped(self):
        px = self.proxy(30, usage_decode(total=8))
        r = http_request(px.port, "POST", "/v1/completions",
                         {"model": "m", "prompt": "x", "max_tokens": 31}, auth("alice"))
        self.assertErrorJson(r, 429, "max_tokens past a minute's limit")
        self.assertIn(b"too large", r.body)
        # Without max_tokens, --default-max-tokens (4096) is reserved only up
        # to the limit: such a request is never too large.
        r = http_request(px.port, "POST", "/v1/completions", {"model": "m", "prompt": "x"},
                         auth("alice"))
        self.assertEqual(r.status, 200, r.body)

    def test_wild_usage_is_clamped(self):
        px = self.proxy(100000, usage_decode(total=999999999999999999))
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        self.assertEqual(http_request(px.port, "POST", "/v1/completions", body,
                                      auth("alice")).status, 200)
        r = http_request(px.port, "POST", "/v1/completions", body, auth("alice"))
        self.assertEqual(r.status, 200, "locked out: %r %r" % (r.header("retry-after"), r.body))
        left = int(r.header("x-ratelimit-remaining-tokens"))
        self.assertGreater(left, 100000 - 3000)


class ExtraAnswerEngine(Listener):
    """An engine that answers every request twice, the second time late: on
    a reused connection the previous request's answer again comes first,
    right after the next request arrived (the window HTTP/1.1 cannot tell
    apart by itself). `role` "prefill": a completion whose
    kv_transfer_params.remote_request_id holds the X-Request-Id (as vLLM's
    does); "decode": a completion naming the request. `echo`: the answer's
    head carries the X-Request-Id answered. `early`: the stray goes out as
    soon as the next request's head is in, before its body is read."""

    def __init__(self, role, echo=False, early=False):
        super().__init__(name="extra-" + role)
        self.role, self.echo, self.early = role, echo, early
        self.seen = []
        self.conns = 0
        self.socks = []
        self.start_accepting()

    def close(self):
        self.stop_accepting(join=0)
        for c in self.socks:
            try:
                c.close()
            except OSError:
                pass

    def answer(self, rid):
        if self.role == "prefill":
            doc = {"id": "cmpl-%s" % rid, "object": "text_completion", "model": "m",
                   "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                   "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                          "remote_block_ids": [1], "remote_engine_id": "e",
                                          "remote_request_id": "cmpl-%s-0-1a2b3c4d" % rid,
                                          "remote_host": "127.0.0.1", "remote_port": 1}}
        else:
            doc = {"id": "cmpl-%s" % rid, "object": "text_completion", "model": "m",
                   "choices": [{"index": 0, "text": "answer-for:%s" % rid,
                                "finish_reason": "stop"}]}
        body = json.dumps(doc).encode()
        head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        if self.echo:
            head += "X-Request-Id: %s\r\n" % rid
        return head.encode() + b"\r\n" + body

    def accepted(self, c):
        self.conns += 1
        self.socks.append(c)
        threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def serve(self, c):
        try:
            self.exchange(c)
        except OSError:
            pass  # pdproxy closed the connection: what it refused

    def exchange(self, c):
        buf, last = b"", None
        c.settimeout(10)
        for _ in range(MAX_LOOP):
            while b"\r\n\r\n" not in buf:
                try:
                    data = c.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            fields = dict(l.split(b":", 1) for l in head.split(b"\r\n")[1:] if b":" in l)
            fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
            rid = fields.get(b"x-request-id", b"").decode()
            n = int(fields.get(b"content-length", b"0"))
            if self.early and last is not None:
                c.sendall(self.answer(last))  # before the body is read
            while len(buf) < n:
                data = c.recv(1 << 20)
                if not data:
                    return
                buf += data
            buf = buf[n:]
            self.seen.append(rid)
            if last is not None and not self.early:
                c.sendall(self.answer(last))  # the late extra answer to the previous request
                time.sleep(0.02)  # pacing: the extra answer arrives apart from the right one
            c.sendall(self.answer(rid))
            last = rid


class ExtraAnswerTest(ProdCase):
    """M7: with an engine that sends one answer too many, 241-293 of 320
    clients got another request's answer and 247 of 320 decode requests
    carried another request's kv_transfer_params."""

    def engine(self, role, **kw):
        e = ExtraAnswerEngine(role, **kw)
        self.addCleanup(e.close)
        return e

    def test_prefill_answer_for_another_request_refused(self):
        P = self.engine("prefill")
        D = self.mock(decode_handler(), "d")
        px = self.start([P.port], [D], threads=1)
        codes = []
        for i in range(8):
            r = http_request(px.port, "POST", "/v1/completions",
                             {"model": "m", "prompt": "x", "max_tokens": 2},
                             {"X-Request-Id": "req-%d" % i})
            codes.append(r.status)
            if r.status != 200:  # every retry met a stale answer: refused, said so
                self.assertErrorJson(r, 502, "req-%d" % i)
                self.assertIn(b"another request", r.body)
        self.assertIn(200, codes)
        self.assertEqual(len(D.requests), codes.count(200))
        for dr in D.requests:
            rid = dr.header("x-request-id")
            kv = dr.json()["kv_transfer_params"]
            self.assertIn(rid + "-", kv["remote_request_id"],
                          "decode of %s got another request's kv_transfer_params" % rid)
        self.assertGreater(metric(prom(px.port), "pdproxy_upstream_answers_refused_total",
                                  reason="remote_request_id"), 0)

    def test_decode_answer_echoing_another_id_refused(self):
        p = self.mock(prefill_handler(), "p")
        D = self.engine("decode", echo=True)
        px = self.start([p], [D.port], threads=1)
        codes = []
        for i in range(8):
            rid = "req-%d" % i
            r = http_request(px.port, "POST", "/v1/completions",
                             {"model": "m", "prompt": "x", "max_tokens": 2}, {"X-Request-Id": rid})
            codes.append(r.status)
            if r.status == 200:
                self.assertIn(b"answer-for:%s\"" % rid.encode(), r.body,
                              "client %s got another request's answer" % rid)
            else:
                self.assertErrorJson(r, 502, rid)
                self.assertIn(b"another request", r.body)
        self.assertIn(200, codes)
        self.assertGreater(metric(prom(px.port), "pdproxy_upstream_answers_refused_total",
                                  reason="request_id"), 0)

    def test_answer_before_the_request_was_written_ends_the_connection(self):
        p = self.mock(prefill_handler(), "p")
        D = self.engine("decode", early=True)
        px = self.start([p], [D.port], threads=1)
        big = "y" * (8 << 20)  # more than the socket buffers take at once
        for i in range(3):
            http_request(px.port, "POST", "/v1/completions",
                         {"model": "m", "prompt": big if i == 1 else "x", "max_tokens": 2},
                         {"X-Request-Id": "req-%d" % i}, timeout=30)
        self.assertGreaterEqual(metric(prom(px.port), "pdproxy_upstream_early_answers_total"), 1)
        # The third request did not go on the connection that answered early.
        self.assertEqual(D.conns, 2)


from test_admission import AdmissionCase, adm, request_ids  # noqa: E402


class PriorityClaimTest(AdmissionCase):
    """M5: with --priority-class "premium:-100..-1 standard:0..100", any
    client could claim premium (six loops got 65 answers while a weight-10
    tenant timed out in the queue on 3 of 4 requests)."""

    def test_claims_are_held_to_the_tenants_floor(self):
        px = self.proxy(["--queue-max", "16", "--priority-class",
                         "premium:-100..-1 standard:0..100", "--tenant-keys", keyfile(self),
                         "--tenant", "alice:floor=-100 default:floor=0"])
        self.block(px)
        for i in range(3):  # callers without a key claim premium first
            self.queue(px, "anon-%d" % i, {"x-priority": "premium"})
        self.queue(px, "alice", auth("alice", **{"x-priority": "premium"}))
        self.queue(px, "anon-num", {"x-priority": "-50"})
        self.finish()
        order = request_ids(self.D)[1:]
        self.assertEqual(order[0], "alice", "only alice may claim premium: %r" % order)
        self.assertEqual(sorted(order[1:]), ["anon-0", "anon-1", "anon-2", "anon-num"])

    def test_class_shares_starve_no_class(self):
        px = self.proxy(["--queue-max", "32", "--priority-class",
                         "premium:-100..-1:share=3 standard:0..100:share=1"])
        self.block(px)
        for i in range(8):
            self.queue(px, "prem-%d" % i, {"x-priority": "premium"})
        for i in range(3):
            self.queue(px, "std-%d" % i, {"x-priority": "standard"})
        self.finish()
        order = request_ids(self.D)[1:]
        self.assertEqual(len(order), 11)
        # Rounds of three premium and one standard, not eight premium first.
        self.assertEqual([o[:3] for o in order[:8]],
                         ["pre"] * 3 + ["std"] + ["pre"] * 3 + ["std"], order)

    def test_shares_on_every_class_or_none(self):
        from pdharness.procs import run_pdproxy
        p = run_pdproxy(["--decode", "http://127.0.0.1:9", "--priority-class",
                         "a:0:share=2 b:1"])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("share=", p.stderr)


class LowItemsTest(AdmissionCase):
    def test_malformed_kv_batches_logged_at_a_rate(self):
        hosts = ("127.0.0.2",)
        for _ in range(20):
            kvport = free_port()
            if port_free_on(hosts, kvport):
                break
        pub = Publisher(hosts[0], kvport)
        self.addCleanup(pub.close)
        px = self.start(args=["--decode", "http://127.0.0.2:%d" % free_port(),
                              "--kv-events-port", str(kvport)])
        pub.wait_subscriber()
        n = 3000
        for i in range(n):
            pub.send_raw([b"t", i.to_bytes(8, "big"), b"\xc1garbage"])
        got = wait_value(lambda: metric(prom(px.port), "pdproxy_kv_events_malformed_total"),
                         lambda v: v == n, 20.0)
        self.assertEqual(got, n)
        lines = [l for l in px.stderr().splitlines() if "malformed batch" in l]
        self.assertLessEqual(len(lines), 25, "one line a second at most")
        self.assertGreaterEqual(len(lines), 1)

    def test_queue_timeout_zero_does_not_wait(self):
        px = self.proxy(["--queue-max", "8"])
        self.block(px)  # the pool's only slot is taken: saturated
        r = self.post(px, headers={"x-queue-timeout": "0"})
        self.assertErrorJson(r, 429, "saturated, asked not to wait")
        self.assertIn(b"asked not to wait", r.body)
        self.assertNotIn(b"queue is full", r.body)
        self.assertEqual(adm(px, "no_wait"), 1)
        self.assertEqual(adm(px, "queue_full"), 0)
        self.finish()
        r = self.post(px, headers={"x-queue-timeout": "0"})
        self.assertEqual(r.status, 200, "a pool with room serves it at once")

    def test_admin_admission_refuses_what_it_cannot_take_whole(self):
        from pdharness.ctl import admin, token_file
        d = tmpdir(self)
        tokpath, token = token_file(self, d)
        aport = free_port()
        self.gate.set()
        px = self.proxy(["--tenant", "x", "--admin-port", str(aport), "--admin-token-file",
                         tokpath])
        cases = [({"tenants": "a\u0000b"}, "tenants"),
                 ({"tenants": "a:rpm=1:rpm=5"}, "twice"),
                 ({"pool_max_inflight": "x"}, "pool_max_inflight"),
                 ({"pool_max_inflight": -1}, "pool_max_inflight"),
                 ({"priority_classes": "p\u0000q:1"}, "priority_classes")]
        for body, word in cases:
            st, doc = admin(aport, "POST", "/admin/admission", body, token=token)
            self.assertEqual(st, 400, "%r: %r" % (body, doc))
            self.assertIn(word, doc["error"]["message"], body)
        st, doc = admin(aport, "GET", "/admin/admission", token=token)
        self.assertEqual([t["name"] for t in doc["tenants"]], ["x", "(default)"])


if __name__ == "__main__":
    main()
