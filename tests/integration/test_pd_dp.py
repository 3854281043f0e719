#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Data-parallel ranks: with --prefill-dp-size / --decode-dp-size N each
request to that role names a rank in X-data-parallel-rank (the header
vLLM's OpenAIServing._get_data_parallel_rank reads), the one with the
fewest of pdproxy's requests in flight on that backend, lowest first;
counted per rank in pdproxy_dp_rank_*; prefill and decode sizes differ.
Mocks for the choice, engine-sims (--data-parallel-size) for the echo."""

import threading
import time

from pdharness.case import main
from pdharness.client import RawClient, http_request
from pdharness.mocks import Respond, decode_handler, prefill_handler
from pdharness.pd import PdCase, rid_headers
from pdharness.prom import metric, prom

BODY = {"model": "m", "prompt": "hello", "max_tokens": 3}


def gated(handler, gate):
    """A handler that answers only once `gate` is set (10 s at most)."""
    def h(req):
        gate.wait(10)
        return handler(req)
    return h


def ranks(mock):
    return [q.header("x-data-parallel-rank") for q in mock.requests]


class DpChoiceTest(PdCase):

    def test_sequential_requests_take_rank_zero(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([P], [D], threads=1,
                              extra=["--prefill-dp-size", "2", "--decode-dp-size", "4"])
        for i in range(3):
            r = http_request(px.port, "POST", "/v1/completions", BODY)
            self.assertEqual(r.status, 200)
        # Each ended before the next: every rank idle, the lowest wins.
        self.assertEqual(ranks(P), ["0"] * 3)
        self.assertEqual(ranks(D), ["0"] * 3)
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_requests_total", role="decode",
                                     backend="127.0.0.1:%d" % D.port, rank="0"), 3)
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_in_flight", role="decode",
                                     backend="127.0.0.1:%d" % D.port, rank="0"), 0)

    def test_concurrent_requests_spread_over_the_ranks(self):
        gate = threading.Event()
        self.addCleanup(gate.set)
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(gated(decode_handler(), gate), name="D")
        px = self.start_proxy([P], [D], threads=1,
                              extra=["--prefill-dp-size", "2", "--decode-dp-size", "4"])
        results = []

        def one(i):
            results.append(http_request(px.port, "POST", "/v1/completions", BODY,
                                        headers=rid_headers("c%d" % i,
                                                            {"X-data-parallel-rank": "9"})))
        threads = []
        for i in range(5):
            t = threading.Thread(target=one, args=(i,))
            t.start()
            threads.append(t)
            D.wait_requests(i + 1)  # one at a time, so the order is known
        self.assertEqual(len(D.requests), 5)
        # Four idle ranks, then the least loaded (all at 1): the lowest.
        self.assertEqual(ranks(D), ["0", "1", "2", "3", "0"])
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_in_flight", role="decode",
                                     backend="127.0.0.1:%d" % D.port, rank="0"), 2)
        # Prefills ended one by one: rank 0 every time; the client's header
        # never reaches an engine.
        self.assertEqual(ranks(P), ["0"] * 5)
        gate.set()
        for t in threads:
            t.join(15)
        self.assertEqual(sorted(r.status for r in results), [200] * 5)
        for k, n in (("0", 2), ("1", 1), ("2", 1), ("3", 1)):
            self.assertEqual(self.metric(px, "pdproxy_dp_rank_requests_total", role="decode",
                                         backend="127.0.0.1:%d" % D.port, rank=k), n)
            self.assertEqual(self.metric(px, "pdproxy_dp_rank_in_flight", role="decode",
                                         backend="127.0.0.1:%d" % D.port, rank=k), 0)

    def test_failed_attempts_free_their_rank(self):
        # A prefill that fails is retried: its rank is handed back each time.
        P = self.mock(lambda req: Respond(503, [("Content-Type", "application/json")], b"{}"),
                      name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([P], [D], threads=1,
                              extra=["--prefill-dp-size", "3", "--prefill-retries", "2",
                                     "--fallback-decode-only"])
        r = http_request(px.port, "POST", "/v1/completions", BODY)
        self.assertEqual(r.status, 200)
        self.assertEqual(ranks(P), ["0", "0", "0"])
        self.assertEqual(ranks(D), [None])  # decode has no DP here
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_in_flight", role="prefill",
                                     backend="127.0.0.1:%d" % P.port, rank="0"), 0)

    def test_without_dp_no_header(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([P], [D])
        r = http_request(px.port, "POST", "/v1/completions", BODY,
                         headers={"X-data-parallel-rank": "1"})
        self.assertEqual(r.status, 200)
        self.assertEqual((ranks(P), ranks(D)), ([None], [None]))
        self.assertNotIn("pdproxy_dp_rank_requests_total{", self.prom_text(px))

    def prom_text(self, px):
        return http_request(px.port, "GET", "/metrics").body.decode()


class DpSimTest(PdCase):

    def test_engine_sims_echo_and_count_the_rank(self):
        P = self.engine("prefill", ["--data-parallel-size", "2"])
        D = self.engine("decode", ["--data-parallel-size", "4"])
        px = self.start_proxy([P.port], [D.port], threads=1,
                              extra=["--prefill-dp-size", "2", "--decode-dp-size", "4"])
        body = {"model": "sim-model", "prompt": "one two three four", "max_tokens": 2}
        r = http_request(px.port, "POST", "/v1/completions", body)
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(r.header("x-data-parallel-rank"), None)  # the engine's own header stays
        for port in (P.port, D.port):
            samples = prom(port)
            self.assertEqual(metric(samples, "engine_sim_dp_rank_requests_total", rank="0"), 1)
            self.assertEqual(metric(samples, "engine_sim_dp_rank_requests_total", rank="1"), 0)
        # engine-sim refuses a rank it does not have, and echoes one it has.
        bad = http_request(D.port, "POST", "/v1/completions", body,
                           headers={"X-data-parallel-rank": "4"})
        self.assertErrorJson(bad, 400)
        ok = http_request(D.port, "POST", "/v1/completions", body,
                          headers={"X-data-parallel-rank": "3"})
        self.assertEqual(ok.header("x-data-parallel-rank"), "3")

    def test_rank_the_engine_reports_busy_is_avoided(self):
        # Two long streams sent straight to decode's rank 0 (not through
        # pdproxy): only the engine's per-rank gauges
        # (vllm:num_requests_running{engine="0"}) tell pdproxy that rank 0
        # is busy; its own in-flight counts are all zero.
        P = self.engine("prefill")
        D = self.engine("decode", ["--data-parallel-size", "2", "--itl-ms", "50"])
        body = {"model": "sim-model", "prompt": "one two three four", "max_tokens": 2}
        hogs = []
        for i in range(2):
            c = RawClient(D.port)
            self.addCleanup(c.close)
            c.request("POST", "/v1/completions",
                      dict(body, max_tokens=400, stream=True),
                      headers=[("X-data-parallel-rank", "0")])
            hogs.append(c)
        samples = []
        for _ in range(100):
            samples = prom(D.port)
            if metric(samples, "vllm:num_requests_running", engine="0") == 2:
                break
            time.sleep(0.05)
        self.assertEqual(metric(samples, "vllm:num_requests_running", engine="0"), 2)
        self.assertEqual(metric(samples, "vllm:num_requests_running", engine="1"), 0)
        px = self.start_proxy([P.port], [D.port], threads=1,
                              extra=["--decode-dp-size", "2", "--metrics-interval", "0.1"])
        dname = "127.0.0.1:%d" % D.port
        for _ in range(100):
            if self.metric(px, "pdproxy_dp_rank_engine_load", backend=dname, rank="0") == 2:
                break
            time.sleep(0.05)
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_engine_load", backend=dname,
                                     rank="0"), 2)
        for i in range(3):
            r = http_request(px.port, "POST", "/v1/completions", body)
            self.assertEqual(r.status, 200, r.body)
        # Each request ended before the next: by pdproxy's count alone every
        # one would take rank 0 (test_sequential_requests_take_rank_zero).
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_requests_total", role="decode",
                                     backend=dname, rank="1"), 3)
        self.assertEqual(metric(prom(D.port), "engine_sim_dp_rank_requests_total", rank="1"), 3)
        for c in hogs:
            c.close()
        # The engine saw the streams' clients leave: rank 0 idle again, and
        # pdproxy, probing, goes back to the lowest rank.
        for _ in range(200):
            if self.metric(px, "pdproxy_dp_rank_engine_load", backend=dname, rank="0") == 0:
                break
            time.sleep(0.05)
        r = http_request(px.port, "POST", "/v1/completions", body)
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_requests_total", role="decode",
                                     backend=dname, rank="0"), 1)


class DpRankParseTest(PdCase):

    def test_malformed_rank_series_are_ignored(self):
        # A mock engine's page with odd engine labels: out of range, not a
        # number, negative and huge values. Only the sane series count.
        page = ("# TYPE vllm:num_requests_running gauge\n"
                "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 7\n"
                "vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 0\n"
                "vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 2\n"
                "vllm:num_requests_waiting{engine=\"x\"} 50\n"
                "vllm:num_requests_waiting{engine=\"999\"} 50\n"
                "vllm:num_requests_waiting{engine=\"1\"} -4\n"
                "vllm:num_requests_waiting{engine=\"1\"} 1e300\n"
                "vllm:num_requests_waiting{myengine=\"1\"} 9\n")

        def probes(req):
            if req.path.startswith("/metrics"):
                return Respond(200, [("Content-Type", "text/plain")], page.encode())
            return Respond(200, [("Content-Type", "application/json")], b"{}")
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        D.probe_handler = probes
        px = self.start_proxy([P], [D], threads=1,
                              extra=["--decode-dp-size", "2", "--metrics-interval", "0.1"])
        dname = "127.0.0.1:%d" % D.port
        for _ in range(100):
            if self.metric(px, "pdproxy_dp_rank_engine_load", backend=dname, rank="1") is not None:
                break
            time.sleep(0.05)
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_engine_load", backend=dname,
                                     rank="0"), 9)
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_engine_load", backend=dname,
                                     rank="1"), 0)
        r = http_request(px.port, "POST", "/v1/completions", BODY)
        self.assertEqual(r.status, 200)
        self.assertEqual(ranks(D), ["1"])


if __name__ == "__main__":
    main()
