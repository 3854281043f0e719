#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Reloads under load: clients send requests without pause while the file
is rewritten and SIGHUP sent 50 times, adding and removing prefill and
decode backends. Every request must succeed: a swap is atomic, requests in
flight finish on the configuration they started with, and a removed backend
is not used by requests started after the swap."""

import os
import threading
import unittest

from pdharness.client import http_request
from pdharness.ctl import pools_yaml, sighup, tmpdir, wait_generation, write_yaml
from pdharness.mocks import completion_body, decode_handler, prefill_handler
from pdharness.net import now, wait_until
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom

RELOADS = 50
CLIENTS = 4
MAX_REQUESTS = 5000  # per client: bounds the loop whatever the machine's speed
MAX_SECONDS = 120.0


class ReloadMetricTest(ProdCase):
    def test_a_failed_reload_is_counted(self):
        """A reload that fails leaves the running configuration (logged);
        pdproxy_config_reloads_total{result} and
        pdproxy_config_last_reload_successful say so to Prometheus."""
        P, D = self.mock(prefill_handler(), name="P"), self.mock(decode_handler(), name="D")
        d = tmpdir(self)
        f = os.path.join(d, "pdproxy.yaml")
        write_yaml(f, pools_yaml([("m", ["m"], [P], [D])]))
        px = self.start(args=["--config", f])

        def reloads():
            s = prom(px.port)
            return (metric(s, "pdproxy_config_reloads_total", result="ok"),
                    metric(s, "pdproxy_config_reloads_total", result="failed"),
                    metric(s, "pdproxy_config_last_reload_successful"))
        self.assertEqual(reloads(), (0, 0, 1))
        write_yaml(f, "pools: [this is not: a pool\n")
        sighup(px)
        self.assertTrue(wait_until(lambda: reloads() == (0, 1, 0), 10), reloads())
        write_yaml(f, pools_yaml([("m", ["m"], [P], [D])]))
        sighup(px)
        self.assertTrue(wait_until(lambda: reloads() == (1, 1, 1), 10), reloads())


class ReloadUnderLoadTest(ProdCase):
    def test_50_reloads_under_load_fail_no_request(self):
        P = [self.mock(prefill_handler(), name="P%d" % i) for i in range(3)]
        D = [self.mock(decode_handler(), name="D%d" % i) for i in range(3)]
        d = tmpdir(self)
        f = os.path.join(d, "pdproxy.yaml")

        def layout(i):
            # Every reload changes both roles: a backend leaves, another joins.
            return pools_yaml([("m", ["m"], [P[i % 3], P[(i + 1) % 3]], [D[(i + 2) % 3]]),
                               ("n", ["n"], [P[(i + 2) % 3]], [D[i % 3], D[(i + 1) % 3]])])

        write_yaml(f, layout(0))
        px = self.start(args=["--config", f])
        stop = threading.Event()
        results = [[] for _ in range(CLIENTS)]
        t_end = now() + MAX_SECONDS

        def client(k):
            for j in range(MAX_REQUESTS):
                if stop.is_set() or now() > t_end:
                    return
                body = completion_body(model="m" if (j + k) % 2 else "n")
                try:
                    r = http_request(px.port, "POST", "/v1/completions", body, timeout=20)
                    results[k].append(r.status)
                except Exception as e:  # counted as a failure below
                    results[k].append(repr(e))

        ts = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(CLIENTS)]
        for t in ts:
            t.start()
        for i in range(1, RELOADS + 1):
            write_yaml(f, layout(i))
            sighup(px)
            wait_generation(self, px, i + 1, timeout=20)
        stop.set()
        for t in ts:
            t.join(30)
        self.assertFalse(any(t.is_alive() for t in ts))
        flat = [s for r in results for s in r]
        failed = [s for s in flat if s != 200]
        self.assertGreater(len(flat), RELOADS, "too few requests overlapped the reloads")
        self.assertEqual(failed[:10], [], "%d of %d requests failed during %d reloads"
                         % (len(failed), len(flat), RELOADS))
        self.assertEqual(px.stderr().count("configuration swapped"), RELOADS)
        print("requests=%d failed=%d reloads=%d" % (len(flat), len(failed), RELOADS))


class RemovedBackendTest(ProdCase):
    def test_connections_to_a_removed_backend_close_after_its_last_request(self):
        # pdproxy keeps idle upstream connections for 4 s; a backend removed
        # by a reload must not keep its connections that long.
        P = self.mock(prefill_handler(), name="P")
        D1 = self.mock(decode_handler(), name="D1")
        D2 = self.mock(decode_handler(), name="D2")
        d = tmpdir(self)
        f = os.path.join(d, "pdproxy.yaml")
        write_yaml(f, pools_yaml([("m", ["m"], [P], [D1])]))
        px = self.start(args=["--config", f, "--threads", "1"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(model="m"))
        self.assertEqual(r.status, 200)
        used = set(D1.conn_ids())
        self.assertEqual(len(used), 1)
        conn = [c for c in D1.conns if c.id in used][0]
        self.assertFalse(conn.closed.is_set(), "closed before the reload")
        t0 = now()
        write_yaml(f, pools_yaml([("m", ["m"], [P], [D2])]))
        sighup(px)
        wait_generation(self, px, 2)
        self.assertTrue(conn.closed.wait(2.0), "the removed decode's idle connection stayed open")
        self.assertTrue(conn.closed_by_peer)
        self.assertLess(conn.t_closed - t0, 2.0)
        # The prefill stayed: its connection is still kept.
        pconn = [c for c in P.conns if c.id in set(P.conn_ids())][0]
        self.assertFalse(pconn.closed.is_set(), "a kept backend's connection was closed")
        r = http_request(px.port, "POST", "/v1/completions", completion_body(model="m"))
        self.assertEqual(r.status, 200)
        self.assertEqual(len(D2.requests), 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
