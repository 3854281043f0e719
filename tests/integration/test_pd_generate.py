#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vLLM's token-in /inference/v1/generate through P/D (GenerateRequest:
token_ids, sampling_params, stream, kv_transfer_params; GenerateResponse:
request_id, choices[].token_ids, kv_transfer_params): prefill gets
sampling_params.max_tokens 1 and no stream, decode the client's request
with prefill's kv_transfer_params. Against mocks and engine-sims."""

import json

from pdharness.case import main
from pdharness.client import http_request
from pdharness.mocks import PREFILL_KV, Respond, Stream, default_p_kv, sans_xfer
from pdharness.net import wait_until
from pdharness.pd import PdCase, rid_headers


def gen_prefill(req):
    rid = req.header("x-request-id") or "noid"
    doc = {"request_id": rid, "choices": [{"index": 0, "token_ids": [7],
                                           "finish_reason": "length"}],
           "kv_transfer_params": default_p_kv(rid)}
    return Respond(200, [("Content-Type", "application/json")], json.dumps(doc).encode())


SSE = [b'data: {"request_id":"x","choices":[{"index":0,"token_ids":[5]}]}\n\n',
       b"data: [DONE]\n\n"]


def gen_decode(req):
    if req.json().get("stream") is True:
        return Stream(200, [("Content-Type", "text/event-stream")], [(0.0, c) for c in SSE])
    return Respond(200, [("Content-Type", "application/json")],
                   b'{"request_id":"x","choices":[{"index":0,"token_ids":[5,6]}]}')


class GenerateWireTest(PdCase):

    def test_both_legs(self):
        P = self.mock(gen_prefill, name="P")
        D = self.mock(gen_decode, name="D")
        px = self.start_proxy([P], [D])
        for i, stream in enumerate((False, True)):
            client = {"model": "m", "token_ids": [1, 2, 3, 4], "stream": stream,
                      "sampling_params": {"max_tokens": 30, "min_tokens": 2, "temperature": 0.5,
                                          "top_k": 4},
                      "kv_transfer_params": {"remote_host": "evil"}, "cache_salt": "s"}
            rid = "g-%d" % i
            r = http_request(px.port, "POST", "/inference/v1/generate", client,
                             headers=rid_headers(rid))
            self.assertEqual(r.status, 200, r.body)
            preq = P.requests[i].json()
            self.assertEqual(P.requests[i].path, "/inference/v1/generate")
            self.assertEqual(sans_xfer(preq["kv_transfer_params"]), PREFILL_KV)
            self.assertIs(preq["stream"], False)
            self.assertEqual(preq["sampling_params"],
                             {"temperature": 0.5, "top_k": 4, "max_tokens": 1})
            self.assertEqual(preq["token_ids"], [1, 2, 3, 4])
            self.assertEqual(preq["cache_salt"], "s")
            dreq = D.requests[i].json()
            self.assertEqual(sans_xfer(dreq["kv_transfer_params"]), default_p_kv(rid))
            self.assertEqual(dreq["sampling_params"], client["sampling_params"])
            self.assertIs(dreq["stream"], stream)
            self.assertEqual(self.access_for(px, rid)["decision"], "disaggregated")
            if stream:
                self.assertEqual(r.body, b"".join(SSE))
            else:
                self.assertEqual(json.loads(r.body)["choices"][0]["token_ids"], [5, 6])
        # No sampling_params at all: prefill still gets its one-token limit.
        r = http_request(px.port, "POST", "/inference/v1/generate",
                         {"token_ids": [1], "sampling_params": None})
        self.assertEqual(r.status, 200)
        self.assertEqual(P.requests[2].json()["sampling_params"], {"max_tokens": 1})
        self.assertEqual(self.metric(px, "pdproxy_requests_total",
                                     endpoint="/inference/v1/generate", code="200"), 3)
        r = http_request(px.port, "GET", "/inference/v1/generate")
        self.assertErrorJson(r, 405)

    def test_token_count_is_exact_for_the_decision(self):
        P = self.mock(gen_prefill, name="P")
        D = self.mock(gen_decode, name="D")
        px = self.start_proxy([P], [D], extra=["--disagg-min-tokens", "10"])
        for rid, n in (("short", 9), ("long", 10)):
            r = http_request(px.port, "POST", "/inference/v1/generate",
                             {"token_ids": list(range(n)), "sampling_params": {}},
                             headers=rid_headers(rid))
            self.assertEqual(r.status, 200)
        self.assertEqual(self.access_for(px, "short")["prompt_tokens_est"], "9")
        self.assertEqual(self.access_for(px, "short")["decision"], "decode_only")
        self.assertEqual(self.access_for(px, "long")["decision"], "disaggregated")
        self.assertEqual(len(P.requests), 1)


class GenerateSimTest(PdCase):

    def test_generate_through_engine_sims(self):
        P = self.engine("prefill")
        D = self.engine("decode")
        ref = self.engine("both")
        px = self.start_proxy([P.port], [D.port])
        body = {"model": "sim-model", "token_ids": list(range(1000, 1400)),
                "sampling_params": {"max_tokens": 5, "temperature": 0}}
        r = http_request(px.port, "POST", "/inference/v1/generate", body,
                         headers=rid_headers("gs1"))
        self.assertEqual(r.status, 200, r.body)
        doc = json.loads(r.body)
        local = json.loads(http_request(ref.port, "POST", "/inference/v1/generate", body).body)
        self.assertEqual(doc["request_id"], "gs1")
        self.assertEqual(len(doc["choices"][0]["token_ids"]), 5)
        self.assertEqual(doc["choices"][0]["token_ids"], local["choices"][0]["token_ids"])
        self.assertNotIn("kv_transfer_params", doc)
        r = http_request(px.port, "POST", "/inference/v1/generate", dict(body, stream=True),
                         headers=rid_headers("gs2"))
        self.assertEqual(r.header("content-type"), "text/event-stream")
        lines = [ln[6:] for ln in r.body.decode().splitlines() if ln.startswith("data: ")]
        self.assertEqual(lines[-1], "[DONE]")
        ids = [t for ln in lines[:-1] for t in json.loads(ln)["choices"][0]["token_ids"]]
        self.assertEqual(ids, local["choices"][0]["token_ids"])
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetches_total"), 2)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_prompt_tokens_cached_total"),
                         2 * 399)
        self.assertTrue(wait_until(
            lambda: self.engine_metric(P.port, "engine_sim_kv_blocks_released_by_consumer_total")
            == self.engine_metric(P.port, "engine_sim_kv_blocks_published_total"), 5.0, 0.05))
        # engine-sim refuses what vLLM's GenerateRequest would.
        for bad in ({"token_ids": "abc", "sampling_params": {}},
                    {"token_ids": [1, -2], "sampling_params": {}},
                    {"token_ids": [1]}):
            self.assertErrorJson(http_request(D.port, "POST", "/inference/v1/generate", bad), 400)


if __name__ == "__main__":
    main()
