#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 5 item 8, endpoints: GET /health (liveness), GET /ready (at least
one healthy decode and not draining), GET /v1/models answered by a healthy
decode with its status and body, GET /healthcheck (toy shape)."""

import json
import unittest

from pdharness.client import errmsg, http_request
from pdharness.mocks import Respond, decode_handler, default_probe_handler, prefill_handler
from pdharness.prod import ProdCase

MODELS = {"object": "list", "data": [{"id": "meta-llama/Llama-3.1-8B-Instruct",
                                      "object": "model", "created": 1, "owned_by": "vllm",
                                      "max_model_len": 131072}]}


def models_handler(status=200, body=None, ctype="application/json"):
    data = body if body is not None else json.dumps(MODELS, indent=1).encode()

    def h(req):
        if req.path == "/v1/models":
            return Respond(status, [("Content-Type", ctype), ("X-Engine", "yes")], data)
        return decode_handler()(req)

    return h


def failing_health(mock):
    mock.probe_handler = lambda req: Respond(503, [], b"")


class EndpointsTest(ProdCase):
    ACTIVE = ["--health-interval", "0.1", "--unhealthy-after", "1", "--healthy-after", "1"]

    def test_health_is_liveness(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        failing_health(P)
        failing_health(D)
        px = self.start([P], [D], self.ACTIVE, health_interval=None)
        self.wait_up(px, "decode", D, 0, 3.0)
        r = http_request(px.port, "GET", "/health")
        self.assertEqual(r.status, 200, "liveness does not depend on the backends")
        self.assertEqual(r.json(), {"status": "ok"})
        self.assertEqual((r.header("content-type") or "").split(";")[0], "application/json")

    def test_ready_200_with_a_healthy_decode(self):
        P = self.mock(prefill_handler(), name="P")
        D0 = self.mock(decode_handler(), name="D0")
        D1 = self.mock(decode_handler(), name="D1")
        failing_health(D0)
        px = self.start([P], [D0, D1], self.ACTIVE, health_interval=None)
        self.wait_up(px, "decode", D0, 0, 3.0)
        r = http_request(px.port, "GET", "/ready")
        self.assertEqual(r.status, 200, r)
        doc = r.json()
        self.assertEqual(doc["status"], "ready")
        self.assertIs(doc["draining"], False)
        self.assertEqual(doc["decode"], {"healthy": 1, "total": 2})
        self.assertEqual(doc["prefill"], {"healthy": 1, "total": 1})

    def test_ready_503_without_healthy_decode_then_back(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        failing_health(D)
        px = self.start([P], [D], self.ACTIVE, health_interval=None)
        self.wait_up(px, "decode", D, 0, 3.0)
        r = http_request(px.port, "GET", "/ready")
        self.assertEqual(r.status, 503, r)
        self.assertEqual((r.header("content-type") or "").split(";")[0], "application/json")
        self.assertEqual(r.json()["status"], "not ready")
        D.probe_handler = default_probe_handler
        self.wait_up(px, "decode", D, 1, 3.0)
        self.assertEqual(http_request(px.port, "GET", "/ready").status, 200)

    def test_models_from_a_healthy_decode(self):
        P = self.mock(prefill_handler(), name="P")
        D0 = self.mock(models_handler(body=b'{"object":"list","data":[{"id":"wrong"}]}'),
                       name="D0")
        D1 = self.mock(models_handler(), name="D1")
        failing_health(D0)
        px = self.start([P], [D0, D1], self.ACTIVE, health_interval=None)
        self.wait_up(px, "decode", D0, 0, 3.0)
        want = json.dumps(MODELS, indent=1).encode()
        for i in range(4):
            r = http_request(px.port, "GET", "/v1/models",
                             headers={"Authorization": "Bearer client-key"})
            self.assertEqual(r.status, 200, r)
            self.assertEqual(r.body, want, "the models list is D's body, byte for byte")
            self.assertEqual((r.header("content-type") or "").split(";")[0], "application/json")
        self.assertEqual(D0.requests, [], "an ejected decode was asked for /v1/models")
        self.assertEqual(len(D1.requests), 4)
        for req in D1.requests:
            self.assertEqual((req.method, req.path, req.body), ("GET", "/v1/models", b""))
            self.assertEqual(req.header("authorization"), "Bearer client-key")
        self.assertEqual(P.requests, [], "/v1/models never goes to prefill")

    def test_models_status_and_body_proxied(self):
        P = self.mock(prefill_handler(), name="P")
        body = b'{"error":{"message":"invalid api key","type":"auth","code":401}}'
        D = self.mock(models_handler(status=401, body=body), name="D")
        px = self.start([P], [D])
        r = http_request(px.port, "GET", "/v1/models")
        self.assertEqual(r.status, 401)
        self.assertEqual(r.body, body)

    def test_models_503_without_healthy_decode(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(models_handler(), name="D")
        failing_health(D)
        px = self.start([P], [D], self.ACTIVE, health_interval=None)
        self.wait_up(px, "decode", D, 0, 3.0)
        r = http_request(px.port, "GET", "/v1/models")
        self.assertErrorJson(r, 503)
        self.assertIn("decode", errmsg(r).lower())
        self.assertEqual(D.requests, [])

    def test_healthcheck_toy_shape(self):
        P = [self.mock(prefill_handler(), name="P%d" % i) for i in range(3)]
        D = [self.mock(decode_handler(), name="D%d" % i) for i in range(2)]
        px = self.start(P, D)
        r = http_request(px.port, "GET", "/healthcheck")
        self.assertEqual(r.status, 200)
        self.assertEqual(r.json(), {"status": "ok", "prefill_instances": 3,
                                    "decode_instances": 2})

    def test_probe_endpoints_get_only(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D])
        for path in ("/health", "/ready", "/metrics", "/v1/models"):
            with self.subTest(path=path):
                r = http_request(px.port, "POST", path, b"{}")
                self.assertErrorJson(r, 405)
        self.assertEqual(D.requests, [])


if __name__ == "__main__":
    unittest.main(verbosity=2)
