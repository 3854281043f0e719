#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Multi-model pools: --pool NAME[=MODELS] groups the --prefill/--decode
URLs after it; requests route by the body's model; an unknown model gets
OpenAI's 404 model_not_found; /v1/models lists every pool's models once;
/ready is 200 only when every pool has a usable prefill and decode, and says
per pool and role what is missing; no prefill starts when no decode can take
the request."""

import json
import unittest

from pdharness.client import errmsg, http_request
from pdharness.ctl import url
from pdharness.mocks import completion_body, decode_handler, prefill_handler
from pdharness.net import closed_port, wait_until
from pdharness.procs import run_pdproxy
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom


class PoolsTest(ProdCase):
    def two_pools(self, extra=()):
        self.PA = self.mock(prefill_handler(), name="PA")
        self.DA = self.mock(decode_handler(), name="DA")
        self.PB = self.mock(prefill_handler(), name="PB")
        self.DB = self.mock(decode_handler(), name="DB")
        args = ["--pool", "alpha", "--prefill", url(self.PA), "--decode", url(self.DA),
                "--pool", "beta=beta,beta-chat", "--prefill", url(self.PB), "--decode",
                url(self.DB)] + list(extra)
        return self.start(args=args)

    def test_requests_route_by_model(self):
        px = self.two_pools()
        r = self.post(px, completion_body(model="beta-chat"))
        self.assertEqual(r.status, 200, r.body)
        r = self.post(px, completion_body(model="alpha"))
        self.assertEqual(r.status, 200, r.body)
        r = self.post(px, completion_body(model="beta"))
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(self.PA.requests), 1)
        self.assertEqual(len(self.DA.requests), 1)
        self.assertEqual(len(self.PB.requests), 2)
        self.assertEqual(len(self.DB.requests), 2)
        self.assertEqual(self.DA.requests[0].json()["model"], "alpha")
        # kv_transfer_params from beta's prefill reached beta's decode.
        self.assertIn("kv_transfer_params", self.DB.requests[0].json())

    def test_unknown_model_404_model_not_found(self):
        px = self.two_pools()
        r = self.post(px, completion_body(model="gamma"))
        self.assertEqual(r.status, 404, r.body)
        err = json.loads(bytes(r.body))["error"]
        self.assertEqual(err["code"], "model_not_found")
        self.assertEqual(err["type"], "invalid_request_error")
        self.assertEqual(err["param"], "model")
        self.assertIn("gamma", err["message"])
        r = self.post(px, {"prompt": "no model"})
        self.assertEqual(r.status, 400, r.body)
        for m in (self.PA, self.DA, self.PB, self.DB):
            self.assertEqual(len(m.requests), 0, "a backend saw a request for no pool")

    def test_models_list_merged_and_by_id(self):
        px = self.two_pools()
        r = http_request(px.port, "GET", "/v1/models")
        self.assertEqual(r.status, 200)
        doc = json.loads(bytes(r.body))
        self.assertEqual(doc["object"], "list")
        self.assertEqual([m["id"] for m in doc["data"]], ["alpha", "beta", "beta-chat"])
        r = http_request(px.port, "GET", "/v1/models/beta-chat")
        self.assertEqual(r.status, 200)
        self.assertEqual(json.loads(bytes(r.body))["id"], "beta-chat")
        r = http_request(px.port, "GET", "/v1/models/beta%2Dchat")
        self.assertEqual(json.loads(bytes(r.body))["id"], "beta-chat")
        r = http_request(px.port, "GET", "/v1/models/nope")
        self.assertEqual(r.status, 404)
        self.assertEqual(json.loads(bytes(r.body))["error"]["code"], "model_not_found")

    def test_model_in_two_pools_refused_at_start(self):
        p = run_pdproxy(["--pool", "a=m", "--decode", "http://127.0.0.1:1", "--pool", "b=m",
                         "--decode", "http://127.0.0.1:2", "--print-config"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("model 'm' is served by pool 'a' already", p.stderr)
        p = run_pdproxy(["--prefill", "http://127.0.0.1:1", "--pool", "a",
                         "--decode", "http://127.0.0.1:2", "--print-config"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("outside any pool", p.stderr)

    def test_metrics_carry_pool_label(self):
        px = self.two_pools()
        self.assertEqual(self.post(px, completion_body(model="alpha")).status, 200)
        s = prom(px.port)
        self.assertEqual(metric(s, "pdproxy_backend_up", pool="alpha", role="prefill",
                                backend=self.bname(self.PA)), 1)
        self.assertEqual(metric(s, "pdproxy_backend_up", pool="beta", role="decode",
                                backend=self.bname(self.DB)), 1)
        self.assertEqual(metric(s, "pdproxy_upstream_requests_total", pool="alpha",
                                role="decode", backend=self.bname(self.DA), outcome="ok"), 1)

    def test_unnamed_pool_serves_every_model(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D])
        for m in ("x", "y"):
            self.assertEqual(self.post(px, completion_body(model=m)).status, 200)
        self.assertEqual(len(D.requests), 2)


class ReadyTest(ProdCase):
    def test_ready_names_the_pool_and_role_missing(self):
        PA = self.mock(prefill_handler(), name="PA")
        DA = self.mock(decode_handler(), name="DA")
        PB = self.mock(prefill_handler(), name="PB")
        px = self.start(args=["--pool", "a", "--prefill", url(PA), "--decode", url(DA),
                              "--pool", "b", "--prefill", url(PB)])
        r = http_request(px.port, "GET", "/ready")
        self.assertEqual(r.status, 503)
        doc = json.loads(bytes(r.body))
        pools = {p["name"]: p for p in doc["pools"]}
        self.assertTrue(pools["a"]["ready"])
        self.assertFalse(pools["b"]["ready"])
        self.assertEqual(pools["b"]["missing"], ["decode"])
        self.assertEqual(pools["b"]["decode"]["total"], 0)
        # Pool b's requests: 503 at once, its prefill never asked.
        r = self.post(px, completion_body(model="b"))
        self.assertEqual(r.status, 503, r.body)
        self.assertIn("no decode backend", errmsg(r))
        self.assertEqual(len(PB.requests), 0, "a prefill started with no decode to take it")
        self.assertEqual(self.post(px, completion_body(model="a")).status, 200)

    def test_ready_needs_prefill_unless_fallback(self):
        D = self.mock(decode_handler(), name="D")
        dead = "http://127.0.0.1:%d" % closed_port()
        base = ["--pool", "a", "--prefill", dead, "--decode", url(D), "--unhealthy-after", "1"]
        px = self.start(args=base, health_interval="0.1")
        self.assertTrue(wait_until(
            lambda: http_request(px.port, "GET", "/ready").status == 503, 10.0),
            "ready while the pool's only prefill fails its checks")
        doc = json.loads(bytes(http_request(px.port, "GET", "/ready").body))
        self.assertEqual(doc["pools"][0]["missing"], ["prefill"])
        px2 = self.start(args=base + ["--fallback-decode-only"], health_interval="0.1")
        self.assertTrue(wait_until(
            lambda: json.loads(bytes(http_request(px2.port, "GET", "/ready").body))["pools"][0]
            ["prefill"]["healthy"] == 0, 10.0))
        r = http_request(px2.port, "GET", "/ready")
        self.assertEqual(r.status, 200, r.body)

    def test_no_usable_decode_503_before_prefill(self):
        P = self.mock(prefill_handler(), name="P")
        dead = "http://127.0.0.1:%d" % closed_port()
        px = self.start(args=["--prefill", url(P), "--decode", dead, "--unhealthy-after", "1"],
                        health_interval="0.1")
        self.assertTrue(wait_until(
            lambda: json.loads(bytes(http_request(px.port, "GET", "/ready").body))["decode"]
            ["healthy"] == 0, 10.0))
        r = self.post(px)
        self.assertEqual(r.status, 503, r.body)
        self.assertIn("no prefill was started", errmsg(r))
        self.assertEqual(len(P.requests), 0, "prefill was started with every decode ejected")


if __name__ == "__main__":
    unittest.main(verbosity=2)
