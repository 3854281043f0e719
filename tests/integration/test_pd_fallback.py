#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The decode-only fallback after a failed prefill (--fallback-decode-only):
a prefill that answered 5xx, refused the connection or reset it before its
answer, retries spent, sends the request to decode without
kv_transfer_params; never after a prefill 4xx; without the flag the client
gets the error as before. Counted by reason, named in the access line."""


from pdharness.case import main
from pdharness.client import http_request
from pdharness.mocks import Reset, Respond, Stream, chat_body, decode_handler, sse_events
from pdharness.net import closed_port
from pdharness.pd import PdCase, rid_headers

CLIENT = {"model": "m", "prompt": "hello there", "max_tokens": 7, "stream": False,
          "kv_transfer_params": {"remote_host": "10.0.0.1"}}


def p5xx(req):
    return Respond(503, [("Content-Type", "application/json")], b'{"error":"overloaded"}')


class FallbackTest(PdCase):

    def run_case(self, prefill, reason, retries=1, fallback=True, nprefill=2):
        Ps = [self.mock(prefill, name="P%d" % i) for i in range(nprefill)]
        D = self.mock(decode_handler(), name="D")
        extra = ["--prefill-retries", str(retries)] + (["--fallback-decode-only"] if fallback
                                                        else [])
        px = self.start_proxy(Ps, [D], extra=extra)
        r = http_request(px.port, "POST", "/v1/completions", CLIENT, headers=rid_headers("f1"))
        return px, Ps, D, r

    def check_fallback(self, px, Ps, D, r, reason, attempts):
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(sum(len(P.requests) for P in Ps), attempts, "prefill attempts")
        self.assertEqual(len(D.requests), 1)
        body = D.requests[0].json()
        self.assertNotIn("kv_transfer_params", body, "decode must compute the prefill itself")
        expect = dict(CLIENT)
        del expect["kv_transfer_params"]
        self.assertEqual(body, expect)
        rec = self.access_for(px, "f1")
        self.assertEqual(rec["fallback"], reason)
        self.assertEqual(rec["decision"], "decode_only")
        self.assertEqual(rec["status"], "200")
        self.assertEqual(self.metric(px, "pdproxy_decode_only_fallbacks_total", reason=reason), 1)
        for other in ("prefill_5xx", "prefill_connection_error", "no_healthy_prefill"):
            if other != reason:
                self.assertEqual(self.metric(px, "pdproxy_decode_only_fallbacks_total",
                                             reason=other), 0)

    def test_prefill_5xx_falls_back(self):
        px, Ps, D, r = self.run_case(p5xx, "prefill_5xx", retries=1)
        self.check_fallback(px, Ps, D, r, "prefill_5xx", attempts=2)

    def test_prefill_reset_falls_back(self):
        px, Ps, D, r = self.run_case(lambda req: Reset(), "prefill_connection_error", retries=2)
        self.check_fallback(px, Ps, D, r, "prefill_connection_error", attempts=3)

    def test_prefill_refused_falls_back(self):
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([closed_port()], [D],
                              extra=["--prefill-retries", "1", "--fallback-decode-only",
                                     "--health-interval", "0"])
        r = http_request(px.port, "POST", "/v1/completions", CLIENT, headers=rid_headers("f1"))
        self.check_fallback(px, [], D, r, "prefill_connection_error", attempts=0)

    def test_streamed_fallback(self):
        P = self.mock(p5xx, name="P")
        D = self.mock(lambda req: Stream(200, [("Content-Type", "text/event-stream")],
                                         [(0.0, e) for e in sse_events(["a", "b"])]),
                      name="D")
        px = self.start_proxy([P], [D], extra=["--prefill-retries", "0",
                                               "--fallback-decode-only"])
        r = http_request(px.port, "POST", "/v1/chat/completions",
                         chat_body(stream=True), headers=rid_headers("s1"))
        self.assertEqual(r.status, 200)
        self.assertEqual(r.header("content-type"), "text/event-stream")
        self.assertEqual(r.body, b"".join(sse_events(["a", "b"])))
        self.assertNotIn("kv_transfer_params", D.requests[0].json())
        self.assertEqual(self.access_for(px, "s1")["fallback"], "prefill_5xx")

    def test_without_flag_the_error_stays(self):
        px, Ps, D, r = self.run_case(p5xx, None, retries=1, fallback=False)
        self.assertErrorJson(r, 502)
        self.assertEqual(len(D.requests), 0)
        self.assertNotIn("fallback", self.access_for(px, "f1"))
        self.assertEqual(self.metric(px, "pdproxy_decode_only_fallbacks_total",
                                     reason="prefill_5xx"), 0)

    def test_never_after_a_4xx(self):
        err = b'{"error":{"message":"prompt too long","code":400}}'
        px, Ps, D, r = self.run_case(
            lambda req: Respond(400, [("Content-Type", "application/json")], err), None)
        self.assertEqual(r.status, 400)
        self.assertEqual(r.body, err)
        self.assertEqual(len(D.requests), 0)
        self.assertEqual(sum(len(P.requests) for P in Ps), 1, "a 4xx is not retried")
        self.assertNotIn("fallback", self.access_for(px, "f1"))

    def test_decode_failure_after_fallback_is_an_error(self):
        P = self.mock(p5xx, name="P")
        px = self.start_proxy([P], [closed_port()],
                              extra=["--prefill-retries", "0", "--fallback-decode-only"])
        r = http_request(px.port, "POST", "/v1/completions", CLIENT)
        self.assertErrorJson(r, 502)


if __name__ == "__main__":
    main()
