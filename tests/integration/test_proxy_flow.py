#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The prefill -> decode flow: the P request's rewrite, the D request's body
(P's kv_transfer_params verbatim), X-Request-Id, Authorization, pass-through
of D's answer, round robin, missing kv_transfer_params warnings."""

import copy
import json

from pdharness.case import PxTestCase, main
from pdharness.client import (UUID4_RE, DuplicateKeyError, RawClient, http_request, raw_exchange,
                              strict_json)
from pdharness.mocks import (PREFILL_KV, Respond, chat_body, completion_body, decode_handler,
                             default_p_kv, prefill_handler, sans_xfer)
from pdharness.procs import WARN_RE

BIG1 = 18446744073709551615  # 2^64 - 1
BIG2 = 9007199254740993  # 2^53 + 1: not representable as a double

# P's answer as literal bytes, so the test controls the exact number text and
# escapes: unknown keys, nested objects, lists of lists, integers above 2^53,
# small and inexact floats, non-ASCII as UTF-8 and as \u escapes.
P_KV_RAW = (
    b'{"do_remote_prefill":true,"do_remote_decode":false,'
    b'"remote_block_ids":[[1,2,3],[4,5],[]],'
    b'"remote_engine_id":"eng-\xc3\xa9\xe6\x97\xa5\xf0\x9f\x98\x80",'
    b'"remote_request_id":"cmpl-req-\\u00e9\\ud83d\\ude00-7",'
    b'"remote_host":"127.0.0.1","remote_port":5601,"tp_size":2,'
    b'"remote_num_tokens":18446744073709551615,'
    b'"remote_blocks_expiry_time":9007199254740993,'
    b'"neg":-9223372036854775809,'
    b'"tiny":1e-7,"tenth":0.1,"third":0.3333333333333333,"zero":0,"negzero":-0.0,'
    b'"nested":{"a":{"b":[1,{"c":null,"d":[true,false]}]},"e":"tab\\there\\n\\"q\\"\\\\"},'
    b'"empty_obj":{},"empty_list":[]}'
)
P_ANSWER_RAW = (b'{"id":"cmpl-p","object":"text_completion","created":1,"model":"m",'
                b'"choices":[{"index":0,"text":"x","finish_reason":"length"}],'
                b'"kv_transfer_params":' + P_KV_RAW + b'}')
P_KV = strict_json(P_KV_RAW)


def p_request_expected(client_body):
    """The P body docs/ARCHITECTURE.md §1 prescribes for a given client body."""
    exp = copy.deepcopy(client_body)
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        exp.pop(k, None)
    exp["kv_transfer_params"] = dict(PREFILL_KV)
    exp["stream"] = False
    exp["max_tokens"] = 1
    if "max_completion_tokens" in client_body:
        exp["max_completion_tokens"] = 1
    return exp


def d_request_expected(client_body, p_kv):
    exp = copy.deepcopy(client_body)
    exp.pop("kv_transfer_params", None)
    exp["kv_transfer_params"] = p_kv
    return exp


# A client body with many kinds of values that must survive exactly.
RICH_CLIENT = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "prompt": "Grüße, 世界 \U0001F600 \"quoted\" \\ back\nslash",
    "max_tokens": 50,
    "temperature": 0.7,
    "top_p": 0.1,
    "frequency_penalty": 1e-7,
    "seed": BIG1,
    "user": "user-\u00e9",
    "logit_bias": {"50256": -100, "13": 2.5},
    "stop": ["\n\n", "END"],
    "n": 1,
    "echo": False,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 5,
    "extra_body_field": {"deep": [[1, 2], [3, [4, BIG2]]]},
}


class FlowBase(PxTestCase):
    def setUp(self):
        super().setUp()
        self.P = self.mock(prefill_handler(), name="P")
        self.D = self.mock(decode_handler(), name="D")

    def proxy(self, **kw):
        return self.start_proxy([self.P], [self.D], **kw)


class PrefillRewriteTest(FlowBase):

    def _check_p(self, path, client_body, raw=None):
        px = self.proxy()
        body = raw if raw is not None else json.dumps(client_body).encode("utf-8")
        r = http_request(px.port, "POST", path, body)
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(self.P.requests), 1)
        preq = self.P.requests[0]
        self.assertEqual(preq.method, "POST")
        self.assertEqual(preq.path, path)
        got = preq.json()
        self.assertEqual(sans_xfer(got), p_request_expected(client_body))
        self.assertIs(got["stream"], False)
        return preq

    def test_completions_rewrite(self):
        preq = self._check_p("/v1/completions", RICH_CLIENT)
        # Raw number text of the big integers is kept.
        self.assertIn(b"18446744073709551615", preq.body)
        self.assertIn(b"9007199254740993", preq.body)
        self.assertNotIn(b"max_completion_tokens", preq.body)
        self.assertNotIn(b"stream_options", preq.body)
        self.assertNotIn(b"min_tokens", preq.body)

    def test_chat_completions_rewrite_with_max_completion_tokens(self):
        body = chat_body(max_completion_tokens=300, min_completion_tokens=7, min_tokens=3,
                         stream=True, stream_options={"include_usage": True},
                         tools=[{"type": "function", "function": {"name": "f",
                                                                  "parameters": {}}}])
        preq = self._check_p("/v1/chat/completions", body)
        self.assertEqual(preq.json()["max_completion_tokens"], 1)
        self.assertNotIn("min_completion_tokens", preq.json())

    def test_upstream_requests_are_json(self):
        # vLLM (FastAPI) rejects a body whose Content-Type is not JSON; curl's
        # default for a POST body is application/x-www-form-urlencoded.
        px = self.proxy()
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         {"Content-Type": "text/plain"})
        self.assertEqual(r.status, 200, r.body)
        for req in (self.P.requests[0], self.D.requests[0]):
            self.assertEqual(req.method, "POST")
            cts = req.header_all("content-type")
            self.assertEqual(len(cts), 1, "%r Content-Type headers %r" % (req, cts))
            self.assertEqual(cts[0].split(";")[0].strip().lower(), "application/json")
            if not req.chunked:
                self.assertEqual(req.header("content-length"), str(len(req.body)))

    def test_max_tokens_added_when_absent(self):
        body = {"model": "m", "prompt": "p"}
        preq = self._check_p("/v1/completions", body)
        self.assertEqual(preq.json()["max_tokens"], 1)

    def test_stream_false_stays_false(self):
        self._check_p("/v1/completions", completion_body(stream=False))

    def test_client_kv_transfer_params_replaced_for_p(self):
        body = completion_body(kv_transfer_params={"do_remote_prefill": True,
                                                   "remote_host": "evil", "x": 1})
        preq = self._check_p("/v1/completions", body)
        self.assertNotIn(b"evil", preq.body)

    def test_duplicate_keys_do_not_leak(self):
        # A client body with duplicate keys: pdproxy may reject it (400) or
        # collapse the duplicates, but P must not see a second max_tokens or
        # stream, and the client's kv_transfer_params must not survive.
        raw = (b'{"model":"m","prompt":"dup","max_tokens":50,"max_tokens":60,"stream":true,'
               b'"stream":true,"kv_transfer_params":{"remote_host":"evil-1"},'
               b'"kv_transfer_params":{"remote_host":"evil-2"}}')
        px = self.proxy()
        r = http_request(px.port, "POST", "/v1/completions", raw)
        if r.status == 400:
            self.assertErrorJson(r, 400)
            self.assertEqual(self.P.requests, [])
            return
        self.assertEqual(r.status, 200, r.body)
        for req in self.P.requests + self.D.requests:
            self.assertNotIn(b"evil", req.body, "client kv_transfer_params leaked to %r" % req)
        try:
            p = self.P.requests[0].json()
        except DuplicateKeyError as e:
            self.fail("%s in the body sent to P: %r" % (e, self.P.requests[0].body))
        self.assertEqual((p["max_tokens"], p["stream"]), (1, False))
        # D gets the client's body as the client wrote it; whatever way an
        # engine reads duplicates (last wins in Python), kv_transfer_params is P's.
        rid = self.P.requests[0].header("x-request-id")
        d = json.loads(self.D.requests[0].body)
        self.assertEqual(sans_xfer(d["kv_transfer_params"]), default_p_kv(rid))

    def test_escaped_key_names(self):
        # "max_tok\u0065ns" *is* max_tokens, "kv_transfer_p\u0061rams" *is*
        # kv_transfer_params: a text-level rewrite would miss them.
        raw = (b'{"model":"m","prompt":"esc","max_tok\\u0065ns":50,"str\\u0065am":true,'
               b'"kv_transfer_p\\u0061rams":{"remote_host":"evil-esc"}}')
        px = self.proxy()
        r = http_request(px.port, "POST", "/v1/completions", raw)
        if r.status == 400:
            self.assertErrorJson(r, 400)
            return
        self.assertEqual(r.status, 200, r.body)
        try:
            p = self.P.requests[0].json()
        except DuplicateKeyError as e:
            self.fail("%s in the body sent to P: %r" % (e, self.P.requests[0].body))
        self.assertEqual((p["max_tokens"], p["stream"]), (1, False), self.P.requests[0].body)
        self.assertEqual(sans_xfer(p["kv_transfer_params"]), PREFILL_KV, self.P.requests[0].body)
        for req in self.P.requests + self.D.requests:
            self.assertNotIn(b"evil", req.body, "client kv_transfer_params leaked to %r" % req)

    def test_max_completion_tokens_null_still_set(self):
        body = chat_body(max_completion_tokens=None)
        preq = self._check_p("/v1/chat/completions", body)
        self.assertEqual(preq.json()["max_completion_tokens"], 1)

    def test_deeply_nested_body_no_crash(self):
        px = self.proxy()
        deep = b'{"model":"m","prompt":"x","extra":' + b"[" * 100000 + b"]" * 100000 + b"}"
        r = http_request(px.port, "POST", "/v1/completions", deep)
        self.assertIn(r.status, (200, 400), r.body[:200])
        if r.status == 400:
            self.assertErrorJson(r, 400)
        self.assertTrue(px.alive())

    def test_p_answer_framings(self):
        # P's JSON may come chunked or close-delimited.
        px = self.proxy()
        for framing in ("chunked", "close", "length"):
            with self.subTest(framing=framing):
                kv = default_p_kv(framing)

                def h(req, framing=framing, kv=kv):
                    doc = {"choices": [{"text": "x"}], "kv_transfer_params": kv}
                    return Respond(200, [("Content-Type", "application/json")],
                                   json.dumps(doc).encode(), framing=framing)

                self.P.set_handler(h)
                r = http_request(px.port, "POST", "/v1/completions", completion_body())
                self.assertEqual(r.status, 200, r.body)
                self.assertEqual(sans_xfer(self.D.requests[-1].json()["kv_transfer_params"]),
                                 kv)

    def test_chunked_client_body(self):
        px = self.proxy()
        c = RawClient(px.port)
        self.addCleanup(c.close)
        c.request("POST", "/v1/completions", RICH_CLIENT, chunked=True)
        r = c.read_response()
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(sans_xfer(self.P.requests[0].json()), p_request_expected(RICH_CLIENT))
        rid = self.P.requests[0].header("x-request-id")
        self.assertEqual(sans_xfer(self.D.requests[0].json()),
                         d_request_expected(RICH_CLIENT, default_p_kv(rid)))

    def test_large_body_passes(self):
        # 2 MiB prompt, well under the default 32 MiB limit.
        body = completion_body(prompt="y" * (2 * 1024 * 1024))
        px = self.proxy()
        r = http_request(px.port, "POST", "/v1/completions", body)
        self.assertEqual(r.status, 200, r.body[:200])
        self.assertEqual(self.P.requests[0].json()["prompt"], body["prompt"])
        self.assertEqual(self.D.requests[0].json()["prompt"], body["prompt"])


class DecodeBodyTest(FlowBase):

    def test_kv_params_verbatim_to_d(self):
        self.P.set_handler(prefill_handler(raw_body=P_ANSWER_RAW))
        px = self.proxy()
        r = http_request(px.port, "POST", "/v1/completions", RICH_CLIENT)
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(self.D.requests), 1)
        dreq = self.D.requests[0]
        self.assertEqual(dreq.method, "POST")
        self.assertEqual(dreq.path, "/v1/completions")
        got = dreq.json()
        self.assertEqual(sans_xfer(got), d_request_expected(RICH_CLIENT, P_KV))
        # Exact values where a double would lose them: compare number text.
        for txt in (b"18446744073709551615", b"9007199254740993", b"-9223372036854775809"):
            self.assertIn(txt, dreq.body, "number %s changed on the way to D" % txt)
        kv = got["kv_transfer_params"]
        self.assertEqual(kv["remote_request_id"], "cmpl-req-\u00e9\U0001F600-7")
        self.assertEqual(kv["remote_engine_id"], "eng-\u00e9\u65e5\U0001F600")
        self.assertEqual(kv["tiny"], 1e-7)
        self.assertEqual(kv["tenth"], 0.1)
        self.assertEqual(kv["third"], 0.3333333333333333)
        self.assertIsInstance(kv["zero"], int)
        self.assertIsInstance(kv["tp_size"], int)
        self.assertEqual(kv["remote_block_ids"], [[1, 2, 3], [4, 5], []])
        # A complete answer from P draws no warning.
        spurious = [l for l in px.stderr().splitlines() if WARN_RE.search(l) and
                    ("kv_transfer_params" in l or "remote_request_id" in l)]
        self.assertEqual(spurious, [])

    def test_large_kv_params_verbatim(self):
        kv = default_p_kv("big")
        kv["remote_block_ids"] = list(range(200000))
        kv["remote_block_ids_by_layer"] = [[i, i * 2 ** 60] for i in range(2000)]
        self.P.set_handler(prefill_handler(kv=kv))
        px = self.proxy()
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(sans_xfer(self.D.requests[0].json()["kv_transfer_params"]), kv)

    def test_chat_completions_d_body(self):
        self.P.set_handler(prefill_handler(raw_body=P_ANSWER_RAW))
        px = self.proxy()
        body = chat_body(stream=False, max_completion_tokens=99, min_tokens=2)
        r = http_request(px.port, "POST", "/v1/chat/completions", body)
        self.assertEqual(r.status, 200, r.body)
        dreq = self.D.requests[0]
        self.assertEqual(dreq.path, "/v1/chat/completions")
        self.assertEqual(self.P.requests[0].path, "/v1/chat/completions")
        self.assertEqual(sans_xfer(dreq.json()), d_request_expected(body, P_KV))

    def test_client_kv_params_never_reach_d(self):
        p_kv = default_p_kv("x")
        self.P.set_handler(prefill_handler(kv=p_kv))
        px = self.proxy()
        body = completion_body(kv_transfer_params={"remote_host": "client-evil",
                                                   "remote_block_ids": [666],
                                                   "transfer_id": "client-evil-tid"})
        r = http_request(px.port, "POST", "/v1/completions", body)
        self.assertEqual(r.status, 200, r.body)
        for req in self.P.requests + self.D.requests:
            self.assertNotIn(b"client-evil", req.body)
            self.assertNotIn(b"666", req.body)
        self.assertEqual(sans_xfer(self.D.requests[0].json()["kv_transfer_params"]), p_kv)
        self.assertEqual(sans_xfer(self.P.requests[0].json()["kv_transfer_params"]), PREFILL_KV)
        # The router's transfer_id, the same on both legs, never the client's.
        self.assertEqual(self.D.requests[0].json()["kv_transfer_params"]["transfer_id"],
                         self.P.requests[0].json()["kv_transfer_params"]["transfer_id"])

    def test_no_kv_params_from_p_still_decodes(self):
        doc = {"id": "cmpl-p", "object": "text_completion",
               "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        self.P.set_handler(prefill_handler(raw_body=json.dumps(doc).encode()))
        px = self.proxy()
        body = completion_body(kv_transfer_params={"remote_host": "client-evil"})
        since = len(px.stderr())
        r = http_request(px.port, "POST", "/v1/completions", body)
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(self.D.requests), 1)
        got = self.D.requests[0].json()
        self.assertNotIn("kv_transfer_params", got)
        exp = dict(body)
        del exp["kv_transfer_params"]
        self.assertEqual(got, exp)
        self.assertWarned(px, "kv_transfer_params", since)

    def test_kv_params_without_remote_request_id_warns(self):
        kv = default_p_kv("x")
        del kv["remote_request_id"]
        self.P.set_handler(prefill_handler(kv=kv))
        px = self.proxy()
        since = len(px.stderr())
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(sans_xfer(self.D.requests[0].json()["kv_transfer_params"]), kv)
        self.assertWarned(px, "remote_request_id", since)


class RequestIdTest(FlowBase):

    def _ids(self, resp):
        p_ids = self.P.requests[-1].header_all("x-request-id")
        d_ids = self.D.requests[-1].header_all("x-request-id")
        self.assertEqual(len(p_ids), 1, "P X-Request-Id headers %r" % p_ids)
        self.assertEqual(len(d_ids), 1, "D X-Request-Id headers %r" % d_ids)
        c_ids = resp.header_all("x-request-id")
        self.assertEqual(len(c_ids), 1, "client X-Request-Id headers %r" % c_ids)
        self.assertEqual(p_ids[0], d_ids[0])
        self.assertEqual(p_ids[0], c_ids[0])
        return p_ids[0]

    def test_generated_uuid4_same_on_p_d_and_client(self):
        px = self.proxy()
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200)
        rid = self._ids(r)
        self.assertRegex(rid, UUID4_RE)

    def test_different_requests_different_ids(self):
        px = self.proxy()
        ids = set()
        for _ in range(5):
            r = http_request(px.port, "POST", "/v1/completions", completion_body())
            self.assertEqual(r.status, 200)
            ids.add(self._ids(r))
        self.assertEqual(len(ids), 5)

    def test_client_id_kept(self):
        px = self.proxy()
        for rid in ("my-req-123", "A" * 128, "abc_DEF.ghi:~!@#$%^&*()[]{}<>?/|'=+`,;"):
            with self.subTest(rid=rid):
                r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                                 headers=[("X-Request-Id", rid)])
                self.assertEqual(r.status, 200, r.body)
                self.assertEqual(self._ids(r), rid)

    def test_one_request_id_header_even_if_d_sends_one(self):
        self.D.set_handler(lambda req: Respond(
            200, [("Content-Type", "application/json"), ("X-Request-Id", "d-internal-id")],
            b'{"choices":[]}'))
        px = self.proxy()
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                         headers=[("X-Request-Id", "client-id-77")])
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(r.header_all("x-request-id"), ["client-id-77"])

    def test_client_id_with_space_quote_or_backslash_replaced(self):
        # The contract (README, SECURITY.md): visible ASCII without '"' or
        # '\\', at most 128 bytes. Engines build their ids and log lines from
        # it, so anything else is replaced by a UUIDv4, and P and D get that.
        px = self.proxy()
        for rid in ('say-"hi"', "back\\slash", "with space"):
            with self.subTest(rid=rid):
                r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                                 headers=[("X-Request-Id", rid)])
                self.assertEqual(r.status, 200, r.body)
                got = self._ids(r)
                self.assertNotEqual(got, rid)
                self.assertRegex(got, r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}$")

    def test_client_id_header_name_case_insensitive(self):
        px = self.proxy()
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                         headers=[("x-request-id", "lower-case-name-1")])
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(self._ids(r), "lower-case-name-1")

    def test_invalid_client_id_replaced(self):
        px = self.proxy()
        bad = ["B" * 129, "caf\xc3\xa9-id", "a\tb"]
        for rid in bad:
            with self.subTest(rid=rid):
                r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                                 headers=[("X-Request-Id", rid)])
                self.assertEqual(r.status, 200, r.body)
                got = self._ids(r)
                self.assertRegex(got, UUID4_RE)

    def test_control_char_id_never_forwarded(self):
        # A CTL makes the header field itself invalid (RFC 9110 §5.5): pdproxy
        # may reject the request (400, JSON) or replace the id; the bad id
        # must never reach P or D.
        px = self.proxy()
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                         headers=[("X-Request-Id", "a\x01b")])
        if r.status == 400:
            self.assertErrorJson(r, 400)
            self.assertEqual(self.P.requests, [])
        else:
            self.assertEqual(r.status, 200, r.body)
            self.assertRegex(self._ids(r), UUID4_RE)

    def test_empty_client_id_replaced(self):
        px = self.proxy()
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                         headers=[("X-Request-Id", "")])
        self.assertEqual(r.status, 200, r.body)
        self.assertRegex(self._ids(r), UUID4_RE)


class AuthTest(PxTestCase):

    def _run(self, env=None, client_auth=None):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([P], [D], env=env)
        headers = {"Authorization": client_auth} if client_auth else {}
        r = http_request(px.port, "POST", "/v1/completions", completion_body(), headers)
        self.assertEqual(r.status, 200, r.body)
        return P.requests[0].header_all("authorization"), D.requests[0].header_all("authorization")

    def test_client_authorization_forwarded(self):
        p, d = self._run(env={"OPENAI_API_KEY": "sk-env"}, client_auth="Bearer sk-client-xyz")
        self.assertEqual(p, ["Bearer sk-client-xyz"])
        self.assertEqual(d, ["Bearer sk-client-xyz"])

    def test_client_authorization_forwarded_without_env(self):
        p, d = self._run(client_auth="Basic dXNlcjpwYXNz")
        self.assertEqual(p, ["Basic dXNlcjpwYXNz"])
        self.assertEqual(d, ["Basic dXNlcjpwYXNz"])

    def test_env_key_used_without_client_auth(self):
        p, d = self._run(env={"OPENAI_API_KEY": "sk-env-123"})
        self.assertEqual(p, ["Bearer sk-env-123"])
        self.assertEqual(d, ["Bearer sk-env-123"])

    def test_no_authorization_without_key(self):
        p, d = self._run()
        self.assertEqual(p, [])
        self.assertEqual(d, [])


class ResponsePassThroughTest(FlowBase):

    def test_json_body_byte_identical_and_chunked(self):
        body = ('{ "id" : "cmpl-d",\n\t"choices":[{"text":"Grüße \\u00e9 世界","index":0}],'
                '"big":18446744073709551615,"f":1.0E-7 }').encode("utf-8")
        self.D.set_handler(decode_handler(body=body,
                                          content_type="application/json; charset=utf-8"))
        px = self.proxy()
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200)
        self.assertEqual(r.header("content-type"), "application/json; charset=utf-8")
        self.assertChunkedComplete(r)
        self.assertEqual(bytes(r.body), body)

    def test_large_body_byte_identical(self):
        import random
        body = random.Random(7).randbytes(300_000)
        self.D.set_handler(decode_handler(body=body, content_type="application/octet-stream"))
        px = self.proxy()
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200)
        self.assertTrue(r.complete, r)
        self.assertEqual(r.header("content-type"), "application/octet-stream")
        self.assertEqual(bytes(r.body), body)

    def test_multi_mib_bodies(self):
        # Bodies well past pdproxy's per-stream buffer (~1 MiB): they must
        # keep flowing to a client that reads normally.
        import random
        body = random.Random(11).randbytes(8 * 1024 * 1024)
        px = self.proxy()
        for framing in ("length", "chunked"):
            with self.subTest(framing=framing):
                self.D.set_handler(decode_handler(
                    body=body, content_type="application/octet-stream", framing=framing))
                r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                                 timeout=10)
                self.assertEqual(r.status, 200)
                self.assertFalse(r.timed_out, "stuck after %d of %d bytes" % (len(r.body),
                                                                            len(body)))
                self.assertTrue(r.complete, r)
                self.assertTrue(bytes(r.body) == body, "8 MiB body changed on the way")

    def test_d_chunked_and_close_delimited_bodies(self):
        body = b'{"choices":[{"text":"abc"}]}\n'
        px = self.proxy()
        for framing in ("chunked", "close", "length"):
            with self.subTest(framing=framing):
                self.D.set_handler(decode_handler(body=body, framing=framing))
                r = raw_exchange(px.port, "POST", "/v1/completions", completion_body())
                self.assertEqual(r.status, 200)
                self.assertTrue(r.complete, r)
                self.assertEqual(bytes(r.body), body)

    def test_d_status_passed_through(self):
        px = self.proxy()
        for status in (201, 400, 422, 500, 503):
            with self.subTest(status=status):
                body = ('{"error":{"message":"d says %d","type":"X","code":%d}}' % (
                    status, status)).encode()
                self.D.set_handler(decode_handler(body=body, status=status,
                                                  content_type="application/json"))
                r = raw_exchange(px.port, "POST", "/v1/completions", completion_body())
                self.assertEqual(r.status, status)
                self.assertEqual(bytes(r.body), body)
                self.assertEqual(r.header("content-type"), "application/json")

    def test_d_content_type_kept(self):
        self.D.set_handler(decode_handler(body=b"plain text\n",
                                          content_type="text/plain; charset=iso-8859-1"))
        px = self.proxy()
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.header("content-type"), "text/plain; charset=iso-8859-1")
        self.assertEqual(r.body, b"plain text\n")


class HostNameTest(PxTestCase):
    """Backends named by a host name: each address the name resolves to is a
    backend, reached at that address while the request keeps the name (Host;
    with https://, SNI and the certificate check as well)."""

    def test_backends_by_name(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([("localhost", P.port)], [("localhost", D.port)])
        for i in range(3):
            r = http_request(px.port, "POST", "/v1/completions",
                             completion_body(prompt="by-name-%d" % i))
            self.assertEqual(r.status, 200, r.body)
        for m in (P, D):
            self.assertTrue(m.requests)
            self.assertEqual(m.requests[-1].header("host"), "localhost:%d" % m.port)


class RoundRobinTest(PxTestCase):

    def _run(self, n_p, n_d, n_req, threads):
        ps = [self.mock(prefill_handler(), name="p%d" % i) for i in range(n_p)]
        ds = [self.mock(decode_handler(), name="d%d" % i) for i in range(n_d)]
        px = self.start_proxy(ps, ds, threads=threads)
        for i in range(n_req):
            r = http_request(px.port, "POST", "/v1/completions", completion_body(
                prompt="req-%d" % i))
            self.assertEqual(r.status, 200, r.body)

        def order(mocks):
            seq = []
            for idx, m in enumerate(mocks):
                for req in m.requests:
                    seq.append((strict_json(req.body)["prompt"], idx))
            seq.sort(key=lambda x: int(x[0].split("-")[1]))
            return [idx for _, idx in seq]

        return order(ps), order(ds)

    def test_round_robin_independent(self):
        p_seq, d_seq = self._run(2, 3, 6, threads=1)
        self.assertEqual(len(p_seq), 6)
        self.assertEqual(len(d_seq), 6)
        p0, d0 = p_seq[0], d_seq[0]
        self.assertEqual(p_seq, [(p0 + i) % 2 for i in range(6)], "P order %r" % p_seq)
        self.assertEqual(d_seq, [(d0 + i) % 3 for i in range(6)], "D order %r" % d_seq)

    def test_round_robin_balanced_with_threads(self):
        p_seq, d_seq = self._run(2, 3, 12, threads=4)
        self.assertEqual(sorted(p_seq.count(i) for i in range(2)), [6, 6], "P order %r" % p_seq)
        self.assertEqual(sorted(d_seq.count(i) for i in range(3)), [4, 4, 4], "D order %r" % d_seq)


if __name__ == "__main__":
    main()
