#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Every endpoint a vLLM front serves: /v1/messages disaggregated like chat
(vLLM's AnthropicMessagesRequest takes kv_transfer_params; /v1/responses and
/inference/v1/generate: test_pd_responses.py, test_pd_generate.py), every other engine endpoint passed to a decode unchanged (method, target,
headers, body; status, Content-Type, streamed bytes), with the API's auth,
metrics and access log; unknown paths stay 404."""

import json

from pdharness.case import main
from pdharness.client import RawClient, http_request
from pdharness.mocks import (PREFILL_KV, Respond, Stream, decode_handler, default_p_kv,
                             prefill_handler, sans_xfer)
from pdharness.net import closed_port
from pdharness.pd import PdCase, rid_headers

SSE = [b'data: {"type":"response.created","seq":0}\n\n',
       b'data: {"type":"response.output_text.delta","delta":"h\xc3\xa9"}\n\n',
       b'data: {"type":"response.completed"}\n\n']


def echo_decode(status=200, ctype="application/json", body=b'{"ok":true}'):
    return lambda req: Respond(status, [("Content-Type", ctype)], body)


class PassThroughTest(PdCase):

    def setUp(self):
        super().setUp()
        self.P = self.mock(prefill_handler(), name="P")

    def start(self, decode_handler, extra=()):
        self.D = self.mock(decode_handler, name="D")
        return self.start_proxy([self.P], [self.D], extra=list(extra))

    def test_post_endpoints_reach_decode_unchanged(self):
        px = self.start(echo_decode(201, "application/x-custom", b"\x00raw\xffbytes"))
        # Bytes that a JSON re-serialisation would change, and a body that is no JSON at all.
        bodies = [b'{"input": ["a",  "b"], "model":"m", "kv_transfer_params": {"x": 1}, '
                  b'"n": 18446744073709551615}',
                  b"not json at all \xff"]
        paths = ["/v1/embeddings", "/tokenize", "/detokenize", "/pooling", "/score", "/rerank",
                 "/v1/score", "/v2/rerank", "/classify", "/v1/chat/completions/render",
                 "/v1/embeddings?dimensions=4&x=%2F"]
        n = 0
        for path in paths:
            for body in bodies:
                rid = "pt-%d" % n
                r = http_request(px.port, "POST", path, body,
                                 headers=rid_headers(rid, {"Content-Type": "text/x-odd; q=1",
                                                           "X-Custom": "v a l",
                                                           "Accept": "*/*",
                                                           "Accept-Encoding": "gzip",
                                                           "Connection": "keep-alive, X-Custom2",
                                                           "Traceparent": "garbage"}))
                self.assertEqual(r.status, 201, (path, r.body))
                self.assertEqual(r.body, b"\x00raw\xffbytes")
                self.assertEqual(r.header("content-type"), "application/x-custom")
                self.assertEqual(r.header("x-request-id"), rid)
                got = self.D.requests[n]
                self.assertEqual(got.method, "POST")
                self.assertEqual(got.path, path)
                # Bytes kept, but the client's kv_transfer_params go (issue 30).
                self.assertEqual(got.body, body.replace(b', "kv_transfer_params": {"x": 1}', b"")
                                 .replace(b'{"input": ["a",  "b"], "model":"m", "n": ',
                                          b'{"input":["a",  "b"],"model":"m","n":'))
                self.assertEqual(got.header("content-type"), "text/x-odd; q=1")
                # One header allow-list for every route (issue 30).
                self.assertIsNone(got.header("x-custom"))
                self.assertEqual(got.header("accept"), "*/*")
                self.assertEqual(got.header("x-request-id"), rid)
                self.assertEqual(len(got.header_all("content-type")), 1)
                # Only Content-Type of decode's headers comes back: no
                # compressed answers; the connection's own stay here.
                self.assertIsNone(got.header("accept-encoding"))
                self.assertNotEqual(got.header("connection") or "", "keep-alive, X-Custom2")
                self.assertNotEqual(got.header("traceparent"), "garbage")
                self.assertEqual(len(got.header_all("traceparent")), 1)
                n += 1
        self.assertEqual(len(self.P.requests), 0, "prefill must not see passed-through requests")
        self.assertEqual(self.metric(px, "pdproxy_requests_total", endpoint="passthrough",
                                     code="201"), n)
        rec = self.access_for(px, "pt-0")
        self.assertEqual(rec["endpoint"], "/v1/embeddings")
        self.assertEqual(rec["status"], "201")
        self.assertNotIn("prefill", rec)

    def test_other_methods_and_queries(self):
        px = self.start(echo_decode(200, "application/json", b'{"id":"m1"}'))
        cases = [("GET", "/v1/models/m1?x=1", None), ("DELETE", "/v1/responses/resp_1", None),
                 ("GET", "/v1/responses/resp_1?stream=true&starting_after=3", None),
                 ("POST", "/v1/responses/resp_1/cancel", b""),
                 ("PUT", "/v1/files/f", b"abc"), ("PATCH", "/v1/x", b"{}")]
        for i, (method, path, body) in enumerate(cases):
            r = http_request(px.port, method, path, body)
            self.assertEqual(r.status, 200, (method, path, r.body))
            self.assertEqual(r.body, b'{"id":"m1"}')
            got = self.D.requests[i]
            self.assertEqual((got.method, got.path), (method, path))
            self.assertEqual(got.body, body or b"")
            if body is None:
                self.assertIsNone(got.header("content-length"), "a GET/DELETE without a body")
        self.assertEqual(len(self.P.requests), 0)

    def test_decode_status_and_stream_pass_through(self):
        chunks = [(0.0, c) for c in SSE]
        px = self.start(lambda req: Stream(200, [("Content-Type", "text/event-stream")], chunks))
        r = http_request(px.port, "POST", "/v1/audio/transcriptions",
                         b"--b\r\nContent-Disposition: form-data; name=file\r\n\r\n\x01\x02\r\n--b--",
                         headers={"Content-Type": "multipart/form-data; boundary=b"})
        self.assertEqual(r.status, 200)
        self.assertEqual(r.header("content-type"), "text/event-stream")
        self.assertEqual(r.body, b"".join(SSE))
        self.assertEqual(self.D.requests[0].header("content-type"),
                         "multipart/form-data; boundary=b")

    def test_decode_error_status_passes(self):
        px = self.start(echo_decode(404, "application/json",
                                    b'{"error":{"message":"The model `x` does not exist."}}'))
        r = http_request(px.port, "GET", "/v1/models/x")
        self.assertEqual(r.status, 404)
        self.assertEqual(r.body, b'{"error":{"message":"The model `x` does not exist."}}')

    def test_decode_unreachable_is_an_openai_error(self):
        self.D = None
        px = self.start_proxy([self.P], [closed_port()])
        r = http_request(px.port, "POST", "/tokenize", b'{"prompt":"x"}')
        self.assertErrorJson(r, 502)

    def test_unknown_paths_stay_404(self):
        px = self.start(echo_decode())
        for path in ("/v2/foo", "/tokenizex", "/v1", "/tokenize/x", "/healthz", "/score/1",
                     "/admin"):
            for method in ("GET", "POST"):
                r = http_request(px.port, method, path, b"{}" if method == "POST" else None)
                self.assertErrorJson(r, 404, "%s %s" % (method, path))
        self.assertEqual(len(self.D.requests), 0)

    def test_methods_refused(self):
        px = self.start(echo_decode())
        for method, path in (("HEAD", "/v1/embeddings"), ("OPTIONS", "/tokenize"),
                             ("GET", "/v1/messages")):
            c = RawClient(px.port)
            c.send(RawClient.build(method, path))
            resp = c.read_response(method=method)
            c.close()
            self.assertEqual(resp.status, 405, (method, path))
            self.assertTrue(resp.header("allow"), (method, path))
        self.assertEqual(len(self.D.requests), 0)

    def test_auth_applies(self):
        px = self.start(echo_decode(), extra=["--api-key", "sekret"])
        r = http_request(px.port, "POST", "/v1/embeddings", b"{}")
        self.assertErrorJson(r, 401)
        r = http_request(px.port, "GET", "/tokenize", None)
        self.assertErrorJson(r, 401)
        self.assertEqual(len(self.D.requests), 0)
        r = http_request(px.port, "POST", "/v1/embeddings", b"{}",
                         headers={"Authorization": "Bearer sekret"})
        self.assertEqual(r.status, 200)
        self.assertEqual(self.D.requests[0].header("authorization"), "Bearer sekret")
        self.assertEqual(self.metric(px, "pdproxy_requests_total", endpoint="passthrough",
                                     code="401"), 2)


class MessagesTest(PdCase):
    """vLLM's /v1/messages takes and returns kv_transfer_params: P/D as chat."""

    def test_messages_disaggregated(self):
        kv = dict(default_p_kv("m1"), remote_num_tokens=18446744073709551615)
        P = self.mock(prefill_handler(kv=kv), name="P")
        answers = {False: Respond(200, [("Content-Type", "application/json")],
                                  b'{"type":"message","content":[]}'),
                   True: Stream(200, [("Content-Type", "text/event-stream")],
                                [(0.0, b"event: message_start\ndata: {}\n\n"),
                                 (0.0, b"event: message_stop\ndata: {}\n\n")])}
        D = self.mock(lambda req: answers[req.json().get("stream") is True], name="D")
        px = self.start_proxy([P], [D])
        for i, stream in enumerate((False, True)):
            client = {"model": "m", "max_tokens": 64, "stream": stream,
                      "system": "be brief", "kv_transfer_params": {"remote_host": "evil"},
                      "messages": [{"role": "user", "content": "hello"}]}
            r = http_request(px.port, "POST", "/v1/messages", client)
            self.assertEqual(r.status, 200, r.body)
            preq = P.requests[i].json()
            self.assertEqual(P.requests[i].path, "/v1/messages")
            self.assertEqual(sans_xfer(preq["kv_transfer_params"]), PREFILL_KV)
            self.assertIs(preq["stream"], False)
            self.assertEqual(preq["max_tokens"], 1)
            self.assertEqual(preq["messages"], client["messages"])
            dreq = D.requests[i]
            self.assertEqual(dreq.path, "/v1/messages")
            self.assertEqual(sans_xfer(dreq.json()["kv_transfer_params"]), kv)
            self.assertIn(b"18446744073709551615", dreq.body)
            self.assertEqual(dreq.json()["max_tokens"], 64)
            self.assertIs(dreq.json()["stream"], stream)
        self.assertEqual(r.header("content-type"), "text/event-stream")
        self.assertEqual(r.body, b"event: message_start\ndata: {}\n\nevent: message_stop\n"
                                 b"data: {}\n\n")
        self.assertEqual(self.metric(px, "pdproxy_requests_total", endpoint="/v1/messages",
                                     code="200"), 2)

    def test_messages_prefill_4xx_returned(self):
        err = b'{"type":"error","error":{"type":"invalid_request_error","message":"bad"}}'
        P = self.mock(lambda req: Respond(400, [("Content-Type", "application/json")], err))
        D = self.mock(decode_handler())
        px = self.start_proxy([P], [D])
        r = http_request(px.port, "POST", "/v1/messages",
                         {"model": "m", "max_tokens": 1, "messages": []})
        self.assertEqual(r.status, 400)
        self.assertEqual(r.body, err)
        self.assertEqual(len(D.requests), 0)


if __name__ == "__main__":
    main()
