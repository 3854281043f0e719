#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Honest usage across the two legs. Under P/D vLLM's decode reports the
prompt it received from prefill as cached (prompt_tokens_details.
cached_tokens = prompt - 1); with --usage-from prefill (the default) the
client gets prefill's cached_tokens instead, in a non-streamed body and in
the usage chunk of a stream, every other byte untouched; --usage-from decode
passes decode's figure. Requests decode served alone are never touched."""

import json

from pdharness.case import main
from pdharness.client import http_request
from pdharness.mocks import Respond, Stream, chat_body, completion_body, default_p_kv
from pdharness.pd import PdCase, prose, rid_headers


def prefill_with_cached(n):
    def h(req):
        doc = {"id": "cmpl-p", "object": "text_completion", "choices": [],
               "usage": {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101,
                         "prompt_tokens_details": {"cached_tokens": n}},
               "kv_transfer_params": default_p_kv("u")}
        return Respond(200, [("Content-Type", "application/json")], json.dumps(doc).encode())
    return h


# Decode's answer as literal bytes: odd spacing, escapes, a decoy
# "cached_tokens" inside a string and in another object, big numbers.
D_JSON = (b'{"id":"c","choices":[{"text":"say \\"cached_tokens\\": 5","index":0}],\n'
          b' "other":{"prompt_tokens_details":{"cached_tokens":3}},'
          b'"usage" : { "prompt_tokens":100,"completion_tokens":18446744073709551615,'
          b'"prompt_tokens_details" : {"audio_tokens":null, "cached_tokens" : 99 } },"z":"\xc3\xa9"}')
D_EVENTS = [b'data: {"id":"c","choices":[{"delta":{"content":"\\"cached_tokens\\":1"}}]}\n\n',
            b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":100,'
            b'"prompt_tokens_details":{"cached_tokens":99},"completion_tokens":2}}\n\n',
            b'data: [DONE]\n\n']


def split_bytes(data, sizes):
    """data cut into pieces of the given sizes (the rest last): events and
    numbers split across reads."""
    out, at = [], 0
    for n in sizes:
        out.append(data[at:at + n])
        at += n
    out.append(data[at:])
    return [p for p in out if p]


class UsageBytesTest(PdCase):
    """Against mocks: exactly which bytes change."""

    def start(self, decode_handler, mode=None, cached=7):
        self.P = self.mock(prefill_with_cached(cached), name="P")
        self.D = self.mock(decode_handler, name="D")
        extra = ["--usage-from", mode] if mode else []
        return self.start_proxy([self.P], [self.D], extra=extra)

    def test_json_body_default_prefill(self):
        px = self.start(lambda req: Respond(200, [("Content-Type", "application/json")], D_JSON))
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200)
        want = D_JSON.replace(b'"cached_tokens" : 99', b'"cached_tokens" : 7')
        self.assertNotEqual(want, D_JSON)
        self.assertEqual(r.body, want)

    def test_json_body_mode_decode(self):
        px = self.start(lambda req: Respond(200, [("Content-Type", "application/json")], D_JSON),
                        mode="decode")
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.body, D_JSON)

    def test_json_body_chunked_in_pieces(self):
        data = D_JSON
        px = self.start(lambda req: Stream(200, [("Content-Type", "application/json")],
                                           [(0.0, p) for p in split_bytes(data, [1, 50, 170, 3])]))
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.body, D_JSON.replace(b'"cached_tokens" : 99', b'"cached_tokens" : 7'))

    def test_answer_larger_than_the_hold_passes_unchanged(self):
        # The usage sits at the end of a whole JSON answer; past 8 MiB held
        # pdproxy stops waiting for it and passes every byte on as it came.
        big = (b'{"id":"c","choices":[{"text":"' + b"x" * (9 << 20) + b'","index":0}],'
               b'"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":99}}}')
        pieces = [big[i:i + (256 << 10)] for i in range(0, len(big), 256 << 10)]
        px = self.start(lambda req: Stream(200, [("Content-Type", "application/json")],
                                           [(0.0, p) for p in pieces]))
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200)
        self.assertEqual(len(r.body), len(big))
        self.assertEqual(r.body, big)
        # The next request is rewritten as usual: nothing stuck.
        self.D.handler = lambda req: Respond(200, [("Content-Type", "application/json")], D_JSON)
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.body, D_JSON.replace(b'"cached_tokens" : 99', b'"cached_tokens" : 7'))

    def test_stream_usage_chunk(self):
        stream = b"".join(D_EVENTS)
        for mode, want in ((None, stream.replace(b'"cached_tokens":99', b'"cached_tokens":12345')),
                           ("decode", stream)):
            px = self.start(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                               [(0.0, p) for p in
                                                split_bytes(stream, [10, 90, 2, 1, 1, 60])]),
                            mode=mode, cached=12345)
            r = http_request(px.port, "POST", "/v1/chat/completions",
                             chat_body(stream=True,
                                       stream_options={"include_usage": True}))
            self.assertEqual(r.status, 200)
            self.assertEqual(r.header("content-type"), "text/event-stream")
            self.assertEqual(r.body, want, mode)

    def test_stream_with_crlf_events(self):
        stream = b"".join(e.replace(b"\n\n", b"\r\n\r\n") for e in D_EVENTS)
        px = self.start(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                           [(0.0, p) for p in split_bytes(stream, [3, 100, 1])]))
        r = http_request(px.port, "POST", "/v1/chat/completions", chat_body(stream=True))
        self.assertEqual(r.body, stream.replace(b'"cached_tokens":99', b'"cached_tokens":7'))

    def test_prefill_without_details_leaves_decode_bytes(self):
        def p(req):
            doc = {"choices": [], "usage": {"prompt_tokens": 1},
                   "kv_transfer_params": default_p_kv("u")}
            return Respond(200, [("Content-Type", "application/json")], json.dumps(doc).encode())
        self.P = self.mock(p, name="P")
        self.D = self.mock(lambda req: Respond(200, [("Content-Type", "application/json")],
                                               D_JSON), name="D")
        px = self.start_proxy([self.P], [self.D])
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.body, D_JSON)

    def test_decode_error_bodies_untouched(self):
        err = b'{"error":{"message":"x"},"usage":{"prompt_tokens_details":{"cached_tokens":99}}}'
        px = self.start(lambda req: Respond(500, [("Content-Type", "application/json")], err))
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual((r.status, r.body), (500, err))

    def test_decode_only_requests_untouched(self):
        self.P = self.mock(prefill_with_cached(7), name="P")
        self.D = self.mock(lambda req: Respond(200, [("Content-Type", "application/json")],
                                               D_JSON), name="D")
        px = self.start_proxy([self.P], [self.D], extra=["--disagg-min-tokens", "1000000"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.body, D_JSON)
        self.assertEqual(len(self.P.requests), 0)


class UsageSimTest(PdCase):
    """Against an engine-sim P/D pair, which reports usage as vLLM does."""

    def test_both_modes(self):
        P = self.engine("prefill")
        D = self.engine("decode")
        prompt = prose(600, seed=3)
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 4}
        # Sent straight to prefill once: its prefix cache holds the prompt
        # from then on (and it says how many tokens the prompt has).
        direct = json.loads(http_request(P.port, "POST", "/v1/completions", body).body)
        self.assertEqual(direct["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
        ntok = direct["usage"]["prompt_tokens"]
        self.assertGreater(ntok, 40)
        hit = (ntok - 1) // 16 * 16  # prefill's prefix cache hit on a repeat

        got = {}
        for mode in ("prefill", "decode"):
            px = self.start_proxy([P.port], [D.port], extra=["--usage-from", mode])
            for stream in (False, True):
                b = dict(body, stream=stream)
                if stream:
                    b["stream_options"] = {"include_usage": True}
                r = http_request(px.port, "POST", "/v1/completions", b,
                                 headers=rid_headers("%s-%s" % (mode, stream)))
                self.assertEqual(r.status, 200, r.body)
                if stream:
                    events = [json.loads(l[6:]) for l in r.body.decode().split("\n")
                              if l.startswith("data: {")]
                    usage = [e["usage"] for e in events if e.get("usage")]
                    self.assertEqual(len(usage), 1)
                    usage = usage[0]
                else:
                    usage = json.loads(r.body)["usage"]
                self.assertEqual(usage["prompt_tokens"], ntok)
                got[(mode, stream)] = usage["prompt_tokens_details"]["cached_tokens"]
        # Every prompt was disaggregated and prefill had seen it before:
        # prefill's honest figure is its prefix hit; decode's is all but
        # the last token, whatever prefill computed.
        self.assertEqual(got[("prefill", False)], hit)
        self.assertEqual(got[("prefill", True)], hit)
        self.assertEqual(got[("decode", False)], ntok - 1)
        self.assertEqual(got[("decode", True)], ntok - 1)

    def test_first_prompt_reports_nothing_cached(self):
        P = self.engine("prefill")
        D = self.engine("decode")
        px = self.start_proxy([P.port], [D.port])
        body = {"model": "sim-model", "prompt": prose(500, seed=9), "max_tokens": 2}
        r = http_request(px.port, "POST", "/v1/completions", body)
        usage = json.loads(r.body)["usage"]
        self.assertEqual(usage["prompt_tokens_details"]["cached_tokens"], 0)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetches_total"), 1,
                         "the request was disaggregated")


if __name__ == "__main__":
    main()
