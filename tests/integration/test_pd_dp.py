#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Data-parallel ranks: with --prefill-dp-size / --decode-dp-size N each
request to that role names a rank in X-data-parallel-rank (the header
vLLM's OpenAIServing._get_data_parallel_rank reads), the one with the
fewest of pdproxy's requests in flight on that backend, lowest first;
counted per rank in pdproxy_dp_rank_*; prefill and decode sizes differ.
A backend may declare its own size (a file entry {url, dp_size}, the admin
API's "dp_size"); a reload changes it and keeps the ranks' counts. The
engine's per-rank gauges (vllm:num_requests_* labelled engine="K") steer
the choice: a rank the engine reports busy is avoided.
Mocks for the choice, engine-sims (--data-parallel-size) for the echo and
the per-rank gauges."""

import json
import os
import threading

from pdharness.case import main
from pdharness.client import RawClient, http_request
from pdharness.ctl import admin, sighup, tmpdir, token_file, url, wait_generation, write_yaml
from pdharness.mocks import Respond, decode_handler, prefill_handler
from pdharness.net import free_port, wait_value
from pdharness.pd import PdCase, rid_headers
from pdharness.procs import run_pdproxy
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
        samples = wait_value(lambda: prom(D.port),
                             lambda sm: metric(sm, "vllm:num_requests_running", engine="0") == 2,
                             5.0, 0.05)
        self.assertEqual(metric(samples, "vllm:num_requests_running", engine="0"), 2)
        self.assertEqual(metric(samples, "vllm:num_requests_running", engine="1"), 0)
        px = self.start_proxy([P.port], [D.port], threads=1,
                              extra=["--decode-dp-size", "2", "--metrics-interval", "0.1"])
        dname = "127.0.0.1:%d" % D.port
        load0 = lambda: self.metric(px, "pdproxy_dp_rank_engine_load", backend=dname, rank="0")
        self.assertEqual(wait_value(load0, lambda v: v == 2, 5.0, 0.05), 2)
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
        self.assertEqual(wait_value(load0, lambda v: v == 0, 10.0, 0.05), 0)
        r = http_request(px.port, "POST", "/v1/completions", body)
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_requests_total", role="decode",
                                     backend=dname, rank="0"), 1)


class DpDeclaredTest(PdCase):
    """Backends declaring their own DP size: file entries {url, dp_size},
    POST /admin/backends' "dp_size", a reload changing it."""

    def setUp(self):
        super().setUp()
        self.dir = tmpdir(self)
        self.file = os.path.join(self.dir, "pdproxy.yaml")

    def write(self, prefill, decode, extra=""):
        def entry(x):
            u, n = x if isinstance(x, tuple) else (x, None)
            u = u if isinstance(u, str) else url(u)
            return json.dumps({"url": u, "dp_size": n} if n else u)
        write_yaml(self.file, "%sprefill: [%s]\ndecode: [%s]\n"
                   % (extra, ", ".join(map(entry, prefill)), ", ".join(map(entry, decode))))

    def spread(self, px, D, gate, n, first=0):
        """n requests held at decode (gated), sent one at a time; their
        threads and results."""
        threads, results = [], []
        for i in range(n):
            t = threading.Thread(target=lambda i=i: results.append(
                http_request(px.port, "POST", "/v1/completions", BODY,
                             headers=rid_headers("s%d-%d" % (first, i)))))
            t.start()
            threads.append(t)
            D.wait_requests(first + i + 1)
        return threads, results

    def test_per_backend_sizes_differ_between_roles_and_backends(self):
        gate = threading.Event()
        self.addCleanup(gate.set)
        P1 = self.mock(prefill_handler(), name="P1")
        P2 = self.mock(prefill_handler(), name="P2")
        D = self.mock(gated(decode_handler(), gate), name="D")
        # P1 declares 2 ranks, P2 none (the flags' default: 1), D 3.
        self.write([(P1, 2), P2], [(D, 3)], extra="prefill-policy: round_robin\n")
        px = self.start_proxy(args=["--config", self.file], threads=1)
        threads, results = self.spread(px, D, gate, 4)
        self.assertEqual(ranks(D), ["0", "1", "2", "0"])
        self.assertEqual(ranks(P1), ["0", "0"])
        self.assertEqual(ranks(P2), [None, None])
        gate.set()
        for t in threads:
            t.join(15)
        self.assertEqual([r.status for r in results], [200] * 4)

    def test_bad_dp_size_entries_are_refused(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        for bad, why in (("{url: %s, dp_size: 0}", "dp_size must be an integer in [1, 64]"),
                         ("{url: %s, dp_size: 65}", "dp_size must be an integer in [1, 64]"),
                         ("{url: %s, dp_size: two}", "dp_size must be an integer in [1, 64]"),
                         ("{url: %s, weight: 2}", "a mapping of url and dp_size"),
                         ("{dp_size: 2, x: %s}", "a mapping of url and dp_size")):
            write_yaml(self.file, "prefill: [%s]\ndecode: [%s]\n" % (url(P), bad % url(D)))
            p = run_pdproxy(["--config", self.file, "--print-config"])
            self.assertNotEqual(p.returncode, 0, bad)
            self.assertIn(why, p.stderr, bad)

    def test_print_config_reads_back_the_declarations(self):
        write_yaml(self.file, "pools:\n  - name: m\n"
                   "    prefill: [{url: 'http://127.0.0.1:1', dp_size: 2}, http://127.0.0.1:3]\n"
                   "    decode: [{url: 'http://127.0.0.1:2', dp_size: 8}]\n")
        p = run_pdproxy(["--config", self.file, "--print-config"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('prefill: [{url: "http://127.0.0.1:1", dp_size: 2}, "http://127.0.0.1:3"]',
                      p.stdout)
        self.assertIn('decode: [{url: "http://127.0.0.1:2", dp_size: 8}]', p.stdout)
        write_yaml(self.file, p.stdout)
        again = run_pdproxy(["--config", self.file, "--print-config"])
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertEqual(again.stdout, p.stdout)

    def test_reload_changes_the_size_and_keeps_the_ranks_load(self):
        gate = threading.Event()
        self.addCleanup(gate.set)
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(gated(decode_handler(), gate), name="D")
        self.write([P], [(D, 2)])
        px = self.start_proxy(args=["--config", self.file], threads=1)
        threads, results = self.spread(px, D, gate, 2)
        self.assertEqual(ranks(D), ["0", "1"])
        # Reload: D now has 4 ranks. Its first two still hold a request
        # each (the counts survive the reload): the next go to 2 and 3.
        self.write([P], [(D, 4)])
        sighup(px)
        wait_generation(self, px, 2)
        more, res2 = self.spread(px, D, gate, 3, first=2)
        self.assertEqual(ranks(D), ["0", "1", "2", "3", "0"])
        # Reload without the declaration: the flags' default (1), no rank.
        self.write([P], [D])
        sighup(px)
        wait_generation(self, px, 3)
        gate.set()
        for t in threads + more:
            t.join(15)
        r = http_request(px.port, "POST", "/v1/completions", BODY)
        self.assertEqual(r.status, 200)
        self.assertEqual(ranks(D)[-1], None)
        self.assertEqual([x.status for x in results + res2], [200] * 5)
        for k in range(4):
            self.assertEqual(self.metric(px, "pdproxy_dp_rank_in_flight", role="decode",
                                         backend="127.0.0.1:%d" % D.port, rank=str(k)), 0)

    def test_admin_add_with_dp_size(self):
        tokpath, token = token_file(self, self.dir)
        P = self.mock(prefill_handler(), name="P")
        D1 = self.mock(decode_handler(), name="D1")
        gate = threading.Event()
        self.addCleanup(gate.set)
        D2 = self.mock(gated(decode_handler(), gate), name="D2")
        self.write([P], [D1])
        aport = free_port()
        px = self.start_proxy(args=["--config", self.file, "--admin-port", str(aport),
                                    "--admin-token-file", tokpath], threads=1)
        for bad in (0, 65, "2", 2.5, -1, None):
            st, doc = admin(aport, "POST", "/admin/backends",
                            {"role": "decode", "url": url(D2), "dp_size": bad}, token)
            self.assertEqual(st, 400, bad)
            self.assertIn("dp_size", doc["error"]["message"])
        st, doc = admin(aport, "POST", "/admin/backends",
                        {"role": "decode", "url": url(D2), "dp_size": 3}, token)
        self.assertEqual(st, 201, doc)
        st, doc = admin(aport, "DELETE", "/admin/backends",
                        {"role": "decode", "url": url(D1)}, token)
        self.assertEqual(st, 200, doc)
        threads, results = self.spread(px, D2, gate, 4)
        self.assertEqual(ranks(D2), ["0", "1", "2", "0"])
        self.assertEqual(ranks(D1), [])
        gate.set()
        for t in threads:
            t.join(15)
        self.assertEqual([r.status for r in results], [200] * 4)
        # Removed and added again without dp_size: the API's size is gone.
        for method, u in (("POST", D1), ("DELETE", D2), ("POST", D2), ("DELETE", D1)):
            st, doc = admin(aport, method, "/admin/backends",
                            {"role": "decode", "url": url(u)}, token)
            self.assertEqual(st, 201 if method == "POST" else 200, doc)
        r = http_request(px.port, "POST", "/v1/completions", BODY)
        self.assertEqual(r.status, 200)
        self.assertEqual(ranks(D2)[-1], None)


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
        wait_value(lambda: self.metric(px, "pdproxy_dp_rank_engine_load", backend=dname,
                                       rank="1"), lambda v: v is not None, 5.0, 0.05)
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_engine_load", backend=dname,
                                     rank="0"), 9)
        self.assertEqual(self.metric(px, "pdproxy_dp_rank_engine_load", backend=dname,
                                     rank="1"), 0)
        r = http_request(px.port, "POST", "/v1/completions", BODY)
        self.assertEqual(r.status, 200)
        self.assertEqual(ranks(D), ["1"])


if __name__ == "__main__":
    main()
