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
    (merged into extra_args) on every route."""

import json

from pdharness.case import main
from pdharness.client import RawClient, http_request
from pdharness.mocks import decode_handler, prefill_handler
from pdharness.prod import ProdCase
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


if __name__ == "__main__":
    main()
