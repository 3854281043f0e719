#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A decode that fails to load prefill's KV. vLLM's default
kv_load_failure_policy is "fail": the request finishes with finish_reason
"error" and the OpenAI front answers its GenerationError, HTTP 500
{"error":{"message":"Internal server error","type":"InternalServerError",
...}} or, streamed, a 200 whose first event is that error. With
--fallback-decode-only pdproxy holds decode's answer until it can tell, and
retries once without kv_transfer_params (decode computes the prompt) when
nothing has reached the client; counted as the kv_load_failed fallback.
Mocks for the wire, engine-sim (--kv-load-failure-policy fail) for the real
shape."""

import json

from pdharness.case import main
from pdharness.client import http_request
from pdharness.mocks import Respond, Stream, decode_handler, prefill_handler, sse_events
from pdharness.net import closed_port
from pdharness.pd import PdCase, prose, rid_headers

GEN_ERR = (b'{"error":{"message":"Internal server error","type":"InternalServerError",'
           b'"param":null,"code":500}}')
CLIENT = {"model": "m", "prompt": "hello there", "max_tokens": 7}


def failing_decode(stream_ok=None, fail_always=False, err=GEN_ERR):
    """D: fails the KV load of every request with kv_transfer_params."""
    ok = decode_handler()

    def h(req):
        doc = req.json()
        streamed = doc.get("stream") is True
        if "kv_transfer_params" in doc or fail_always:
            if streamed:
                return Stream(200, [("Content-Type", "text/event-stream")],
                              [(0.0, b"data: " + err + b"\n\n"), (0.0, b"data: [DONE]\n\n")])
            return Respond(500, [("Content-Type", "application/json")], err)
        if streamed:
            return Stream(200, [("Content-Type", "text/event-stream")],
                          [(0.0, c) for c in (stream_ok or sse_events(["a", "b"]))])
        return ok(req)
    return h


class KvLoadFailureTest(PdCase):

    def setup(self, decode, fallback=True):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode, name="D")
        px = self.start_proxy([P], [D], extra=["--fallback-decode-only"] if fallback else [])
        return px, P, D

    def check_retried(self, px, D, rid):
        self.assertEqual(len(D.requests), 2)
        self.assertIn("kv_transfer_params", D.requests[0].json())
        self.assertNotIn("kv_transfer_params", D.requests[1].json())
        self.assertEqual(D.requests[1].json()["prompt"], "hello there")
        rec = self.access_for(px, rid)
        self.assertEqual((rec["decision"], rec["decision_reason"], rec["fallback"]),
                         ("decode_only", "kv_load_failed", "kv_load_failed"))
        self.assertEqual(rec["status"], "200")
        self.assertEqual(self.metric(px, "pdproxy_decode_only_fallbacks_total",
                                     reason="kv_load_failed"), 1)

    def test_json_500_retried_without_kv(self):
        px, P, D = self.setup(failing_decode())
        r = http_request(px.port, "POST", "/v1/completions", CLIENT, headers=rid_headers("k1"))
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(json.loads(r.body)["choices"][0]["text"], "decoded:1")
        self.check_retried(px, D, "k1")
        self.assertIn("decode failed to load prefill's KV", px.stderr())

    def test_stream_error_event_retried(self):
        px, P, D = self.setup(failing_decode())
        r = http_request(px.port, "POST", "/v1/completions", dict(CLIENT, stream=True),
                         headers=rid_headers("k2"))
        self.assertEqual(r.status, 200)
        self.assertEqual(r.body, b"".join(sse_events(["a", "b"])))
        self.check_retried(px, D, "k2")

    def test_error_event_split_across_reads(self):
        # The first event arrives a few bytes at a time: held until it is whole.
        def d(req):
            if "kv_transfer_params" in req.json():
                ev = b"data: " + GEN_ERR + b"\n\n"
                return Stream(200, [("Content-Type", "text/event-stream")],
                              [(0.02, ev[i:i + 7]) for i in range(0, len(ev), 7)] +
                              [(0.0, b"data: [DONE]\n\n")])
            return Stream(200, [("Content-Type", "text/event-stream")],
                          [(0.0, c) for c in sse_events(["z"])])
        px, P, D = self.setup(d)
        r = http_request(px.port, "POST", "/v1/completions", dict(CLIENT, stream=True),
                         headers=rid_headers("k3"))
        self.assertEqual(r.body, b"".join(sse_events(["z"])))
        self.check_retried(px, D, "k3")

    def test_without_flag_the_error_reaches_the_client(self):
        px, P, D = self.setup(failing_decode(), fallback=False)
        r = http_request(px.port, "POST", "/v1/completions", CLIENT, headers=rid_headers("k4"))
        self.assertEqual(r.status, 500)
        self.assertEqual(r.body, GEN_ERR)
        r = http_request(px.port, "POST", "/v1/completions", dict(CLIENT, stream=True),
                         headers=rid_headers("k5"))
        self.assertEqual(r.status, 200)
        self.assertTrue(r.body.startswith(b"data: " + GEN_ERR))
        self.assertEqual(len(D.requests), 2)
        self.assertEqual(self.metric(px, "pdproxy_decode_only_fallbacks_total",
                                     reason="kv_load_failed"), 0)

    def test_retried_once_only(self):
        px, P, D = self.setup(failing_decode(fail_always=True))
        r = http_request(px.port, "POST", "/v1/completions", CLIENT, headers=rid_headers("k6"))
        self.assertEqual(r.status, 500)
        self.assertEqual(r.body, GEN_ERR)
        self.assertEqual(len(D.requests), 2)
        self.assertEqual(self.metric(px, "pdproxy_decode_only_fallbacks_total",
                                     reason="kv_load_failed"), 1)

    def test_other_answers_pass_unchanged(self):
        other = b'{"error":{"message":"boom","type":"BadRequestError","code":500}}'
        px, P, D = self.setup(failing_decode(err=other))
        r = http_request(px.port, "POST", "/v1/completions", CLIENT, headers=rid_headers("k7"))
        self.assertEqual((r.status, r.body), (500, other))
        r = http_request(px.port, "POST", "/v1/completions", dict(CLIENT, stream=True),
                         headers=rid_headers("k8"))
        self.assertEqual(r.body, b"data: " + other + b"\n\ndata: [DONE]\n\n")
        self.assertEqual(len(D.requests), 2)
        # A good stream, held for its first event, reaches the client whole.
        D.set_handler(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         [(0.0, c) for c in sse_events(["x", "y", "w"])]))
        r = http_request(px.port, "POST", "/v1/completions", dict(CLIENT, stream=True),
                         headers=rid_headers("k9"))
        self.assertEqual(r.body, b"".join(sse_events(["x", "y", "w"])))
        self.assertEqual(len(D.requests), 3)
        self.assertEqual(self.metric(px, "pdproxy_decode_only_fallbacks_total",
                                     reason="kv_load_failed"), 0)


class SimKvLoadFailureTest(PdCase):
    """engine-sim as vLLM with kv_load_failure_policy fail: prefill's
    kv_transfer_params name a KV side channel nobody listens on, so the
    load fails for real."""

    def test_engine_sim_fail_policy_then_retry(self):
        port = closed_port()
        ref = self.engine("both")
        body = {"model": "sim-model", "prompt": prose(2400, seed=3), "max_tokens": 4}
        want = json.loads(http_request(ref.port, "POST", "/v1/completions", body).body)
        nblocks = (want["usage"]["prompt_tokens"] + 15) // 16  # engine-sim's 16-token blocks

        def kvp(rid):
            return {"do_remote_prefill": True, "do_remote_decode": False,
                    "remote_block_ids": list(range(nblocks)), "remote_engine_id": "gone",
                    "remote_request_id": "cmpl-%s-1" % rid, "remote_host": "127.0.0.1",
                    "remote_port": port, "tp_size": 1}

        def p(req):
            doc = {"id": "cmpl-p", "object": "text_completion", "choices": [],
                   "kv_transfer_params": kvp(req.header("x-request-id"))}
            return Respond(200, [("Content-Type", "application/json")], json.dumps(doc).encode())
        P = self.mock(p, name="P")
        D = self.engine("decode", ["--kv-load-failure-policy", "fail"])
        # The engine's own answer, straight: vLLM's GenerationError.
        direct = http_request(D.port, "POST", "/v1/completions",
                              dict(body, kv_transfer_params=kvp("direct")))
        self.assertEqual((direct.status, direct.body), (500, GEN_ERR))
        px = self.start_proxy([P], [D.port], extra=["--fallback-decode-only"])
        for i, stream in enumerate((False, True)):
            r = http_request(px.port, "POST", "/v1/completions", dict(body, stream=stream),
                             headers=rid_headers("s%d" % i))
            self.assertEqual(r.status, 200, r.body)
            if stream:
                text = "".join(json.loads(ln[6:])["choices"][0]["text"]
                               for ln in r.body.decode().splitlines()
                               if ln.startswith("data: {"))
            else:
                text = json.loads(r.body)["choices"][0]["text"]
            self.assertEqual(text, want["choices"][0]["text"])
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_load_failed_requests_total"), 3)
        self.assertEqual(self.metric(px, "pdproxy_decode_only_fallbacks_total",
                                     reason="kv_load_failed"), 2)


if __name__ == "__main__":
    main()
