#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""POST /v1/responses through P/D: vLLM's ResponsesRequest takes
kv_transfer_params and its ResponsesResponse returns them (vLLM PR #37424),
so the proxy sends prefill a one-token, unstored, unstreamed request and
decode the client's request with prefill's kv_transfer_params; streamed and
not; previous_response_id reaches both untouched. Against mocks (what
crosses the wire) and engine-sims (the KV really moves, and every published
block is released)."""

import json

from pdharness.case import main
from pdharness.client import http_request
from pdharness.mocks import PREFILL_KV, Respond, Stream, default_p_kv, sans_xfer
from pdharness.net import wait_until
from pdharness.pd import PdCase, prose, rid_headers

SSE = [b'event: response.created\ndata: {"type":"response.created"}\n\n',
       b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
       b'"delta":"h\xc3\xa9"}\n\n',
       b'event: response.completed\ndata: {"type":"response.completed"}\n\n']


def responses_prefill(kv=None):
    def h(req):
        rid = req.header("x-request-id") or "noid"
        doc = {"id": "resp_%s" % rid, "object": "response", "status": "completed",
               "output": [], "kv_transfer_params": kv or default_p_kv(rid)}
        return Respond(200, [("Content-Type", "application/json")], json.dumps(doc).encode())
    return h


def responses_decode(req):
    if req.json().get("stream") is True:
        return Stream(200, [("Content-Type", "text/event-stream")], [(0.0, c) for c in SSE])
    return Respond(200, [("Content-Type", "application/json")], b'{"object":"response"}')


class ResponsesWireTest(PdCase):

    def test_both_legs_carry_what_vllm_expects(self):
        P = self.mock(responses_prefill(), name="P")
        D = self.mock(responses_decode, name="D")
        px = self.start_proxy([P], [D])
        for i, stream in enumerate((False, True)):
            client = {"model": "m", "input": [{"role": "user", "content": "hi"}],
                      "instructions": "be brief", "max_output_tokens": 40, "stream": stream,
                      "store": True, "background": False, "previous_response_id": "resp_prev1",
                      "kv_transfer_params": {"remote_host": "evil"},
                      "stream_options": {"include_obfuscation": False}}
            rid = "rs-%d" % i
            r = http_request(px.port, "POST", "/v1/responses", client, headers=rid_headers(rid))
            self.assertEqual(r.status, 200, r.body)
            p = P.requests[i]
            self.assertEqual(p.path, "/v1/responses")
            preq = p.json()
            self.assertEqual(sans_xfer(preq["kv_transfer_params"]), PREFILL_KV)
            self.assertIs(preq["stream"], False)
            self.assertEqual(preq["max_output_tokens"], 1)
            self.assertIs(preq["store"], False)
            self.assertNotIn("background", preq)
            self.assertNotIn("stream_options", preq)
            self.assertNotIn("max_tokens", preq)  # vLLM would ignore it and generate on
            self.assertEqual(preq["previous_response_id"], "resp_prev1")
            self.assertEqual(preq["input"], client["input"])
            self.assertEqual(preq["instructions"], "be brief")
            d = D.requests[i]
            self.assertEqual(d.path, "/v1/responses")
            dreq = d.json()
            self.assertEqual(sans_xfer(dreq["kv_transfer_params"]), default_p_kv(rid))
            self.assertEqual(dreq["max_output_tokens"], 40)
            self.assertIs(dreq["stream"], stream)
            self.assertIs(dreq["store"], True)
            self.assertEqual(dreq["previous_response_id"], "resp_prev1")
            self.assertEqual(dreq["stream_options"], {"include_obfuscation": False})
            rec = self.access_for(px, rid)
            self.assertEqual(rec["endpoint"], "/v1/responses")
            self.assertEqual(rec["decision"], "disaggregated")
            self.assertTrue(rec.get("prefill"))
            if stream:
                self.assertEqual(r.header("content-type"), "text/event-stream")
                self.assertEqual(r.body, b"".join(SSE))
            else:
                self.assertEqual(r.body, b'{"object":"response"}')
        self.assertEqual(self.metric(px, "pdproxy_requests_total", endpoint="/v1/responses",
                                     code="200"), 2)
        self.assertEqual(self.metric(px, "pdproxy_disagg_decisions_total",
                                     decision="decode_only", reason="endpoint"), 0)
        self.assertIn("/v1/responses, /v1/messages and /inference/v1/generate are "
                      "disaggregated", px.stderr())

    def test_other_methods_and_subpaths(self):
        P = self.mock(responses_prefill(), name="P")
        D = self.mock(lambda req: Respond(200, [("Content-Type", "application/json")],
                                          b'{"object":"response","id":"resp_1"}'), name="D")
        px = self.start_proxy([P], [D])
        r = http_request(px.port, "GET", "/v1/responses")
        self.assertErrorJson(r, 405)
        self.assertEqual(r.header("allow"), "POST")
        # Stored responses and their cancel stay with decode, untouched.
        for method, path in (("GET", "/v1/responses/resp_1"),
                             ("POST", "/v1/responses/resp_1/cancel"),
                             ("DELETE", "/v1/responses/resp_1")):
            r = http_request(px.port, method, path, b"" if method == "POST" else None)
            self.assertEqual(r.status, 200, (method, path, r.body))
        self.assertEqual(len(P.requests), 0)
        self.assertEqual([q.path for q in D.requests],
                         ["/v1/responses/resp_1", "/v1/responses/resp_1/cancel",
                          "/v1/responses/resp_1"])

    def test_bad_bodies_refused_before_any_backend(self):
        P = self.mock(responses_prefill(), name="P")
        D = self.mock(responses_decode, name="D")
        px = self.start_proxy([P], [D])
        for body in (b"not json", b"[1,2]", b'{"input":'):
            r = http_request(px.port, "POST", "/v1/responses", body)
            self.assertErrorJson(r, 400)
        self.assertEqual((len(P.requests), len(D.requests)), (0, 0))

    def test_prefill_without_kv_params_decode_recomputes(self):
        P = self.mock(lambda req: Respond(200, [("Content-Type", "application/json")],
                                          b'{"object":"response","output":[]}'), name="P")
        D = self.mock(responses_decode, name="D")
        px = self.start_proxy([P], [D])
        r = http_request(px.port, "POST", "/v1/responses", {"model": "m", "input": "hi"})
        self.assertEqual(r.status, 200)
        self.assertNotIn("kv_transfer_params", D.requests[0].json())
        self.assertEqual(self.metric(px, "pdproxy_kv_transfer_params_missing_total"), 1)


class ResponsesSimTest(PdCase):
    """engine-sims: the prompt's KV moves from prefill to decode."""

    def test_responses_through_engine_sims(self):
        P = self.engine("prefill")
        D = self.engine("decode")
        ref = self.engine("both")
        px = self.start_proxy([P.port], [D.port])
        text = prose(3000, seed=5)
        body = {"model": "sim-model", "instructions": "answer briefly",
                "input": [{"role": "user", "content": text}], "max_output_tokens": 6,
                "previous_response_id": "resp_earlier"}
        r = http_request(px.port, "POST", "/v1/responses", body, headers=rid_headers("s1"))
        self.assertEqual(r.status, 200, r.body)
        doc = json.loads(r.body)
        local = json.loads(http_request(ref.port, "POST", "/v1/responses", body).body)
        self.assertEqual(doc["object"], "response")
        self.assertEqual(doc["previous_response_id"], "resp_earlier")
        self.assertEqual(doc["output"][0]["content"][0]["text"],
                         local["output"][0]["content"][0]["text"])
        usage = doc["usage"]
        # Decode received all of the prompt but its last token from prefill.
        self.assertEqual(usage["input_tokens_details"]["cached_tokens"],
                         usage["input_tokens"] - 1)
        self.assertEqual(usage["output_tokens"], 6)
        self.assertNotIn("kv_transfer_params", doc)

        r = http_request(px.port, "POST", "/v1/responses", dict(body, stream=True),
                         headers=rid_headers("s2"))
        self.assertEqual(r.status, 200)
        self.assertEqual(r.header("content-type"), "text/event-stream")
        events = [json.loads(line[6:]) for line in r.body.decode().splitlines()
                  if line.startswith("data: ")]
        self.assertEqual(events[0]["type"], "response.created")
        self.assertEqual(events[-1]["type"], "response.completed")
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        self.assertEqual(deltas, local["output"][0]["content"][0]["text"])
        final = events[-1]["response"]
        self.assertEqual(final["usage"]["input_tokens_details"]["cached_tokens"],
                         final["usage"]["input_tokens"] - 1)
        # Every block prefill published was released by decode: none stranded.
        self.assertTrue(wait_until(lambda: self.engine_metric(P.port, "engine_sim_kv_blocks_released_by_"
                                              "consumer_total") ==
                   self.engine_metric(P.port, "engine_sim_kv_blocks_published_total"), 5.0, 0.05))
        self.assertGreater(self.engine_metric(P.port, "engine_sim_kv_blocks_published_total"), 0)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetches_total"), 2)
        self.assertEqual(self.engine_metric(P.port, "engine_sim_requests_total"), 2)


if __name__ == "__main__":
    main()
