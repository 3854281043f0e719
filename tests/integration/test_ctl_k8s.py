#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kubernetes discovery (proxy/k8s.c) against a mock API server speaking the
list + watch protocol over TLS with a bearer token (pdharness/k8sapi.py):
backends follow the EndpointSlices of a Service and of a label selector;
ready endpoints take requests, terminating ones drain, the others leave;
per-engine facts come from named ports and labels; a watch that drops is
resumed from its resourceVersion, a 410 makes a re-list, a rotated token is
read again; 1,000 endpoints churning end as the API says.  Prints the time
from an EndpointSlice change to the routing change and pdproxy's CPU while
1,000 endpoints churn."""

import os
import random
import statistics
import time

from pdharness.case import main
from pdharness.client import http_request
from pdharness.ctl import admin, tmpdir, token_file
from pdharness.k8sapi import K8sApi, ep
from pdharness.mocks import completion_body, decode_handler, prefill_handler
from pdharness.net import HOST, free_port, wait_until
from pdharness.prod import ProdCase

NS = "inference"


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class K8sDiscoveryTest(ProdCase):
    def setUp(self):
        super().setUp()
        self.d = tmpdir(self)
        self.api = K8sApi(self.d).start()
        self.addCleanup(self.api.stop)
        self.tokfile = os.path.join(self.d, "k8s.token")
        with open(self.tokfile, "w") as f:
            f.write(self.api.token + "\n")
        self.admin_port = free_port()
        self.admin_tok_path, self.admin_tok = token_file(self, self.d)

    def proxy(self, prefill, decode, extra=()):
        args = ["--k8s-api", self.api.url, "--k8s-token-file", self.tokfile,
                "--k8s-ca-file", self.api.crt, "--admin-port", str(self.admin_port),
                "--admin-token-file", self.admin_tok_path, "--allow-empty-pools"]
        for u in prefill:
            args += ["--prefill", u]
        for u in decode:
            args += ["--decode", u]
        return self.start(args=args + list(extra))

    def backends(self, role=None):
        """{url: drained} of pdproxy's backends (the admin API's list)."""
        st, doc = admin(self.admin_port, "GET", "/admin/backends", token=self.admin_tok)
        self.assertEqual(st, 200, doc)
        return {b["url"]: b["drained"] for b in doc["backends"]
                if role is None or b["role"] == role}

    def wait_backends(self, role, want, timeout=10.0):
        ok = wait_until(lambda: self.backends(role) == want, timeout, 0.01)
        self.assertTrue(ok, "%s backends %r, wanted %r" % (role, self.backends(role), want))

    def url(self, m):
        return "http://%s:%d" % (HOST, m.port)

    def test_service_and_selector_ready_terminating_facts(self):
        P1, P2 = self.mock(prefill_handler(), "P1"), self.mock(prefill_handler(), "P2")
        D = self.mock(decode_handler(), "D")
        svc = {"kubernetes.io/service-name": "vllm-prefill"}
        self.api.put_slice(NS, "vllm-prefill-a", svc, [("http", P1.port)], [ep(HOST)])
        self.api.put_slice(NS, "decode-x", {"app": "vllm", "role": "decode",
                                            "pdproxy.io/dp-size": "2"},
                           [("metrics", 9), ("http", D.port), ("kv-events", 5557)], [ep(HOST)])
        # Another namespace's slice with the same labels is not ours.
        self.api.put_slice("other", "vllm-prefill-z", svc, [("http", 1)], [ep("10.9.9.9")])
        px = self.proxy(["k8s://%s/vllm-prefill" % NS],
                        ["k8s://%s/?selector=app%%3Dvllm,role%%3Ddecode&port=http" % NS],
                        extra=["--kv-events-port", "5999"])
        self.wait_backends("prefill", {self.url(P1): False})
        self.wait_backends("decode", {self.url(D): False})
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(P1.requests), 1)
        # The decode slice's facts: its DP size label (requests name a rank
        # of two), its kv-events port (where its KV events are read).
        self.assertIn(D.requests[-1].header("x-data-parallel-rank"), ("0", "1"))
        st, doc = admin(self.admin_port, "GET", "/admin/backends", token=self.admin_tok)
        dec = [b for b in doc["backends"] if b["role"] == "decode"][0]
        self.assertEqual(dec.get("kv_events_endpoint"), "tcp://127.0.0.1:5557", dec)
        # A second slice of the Service: its endpoint joins.
        self.api.put_slice(NS, "vllm-prefill-b", svc, [("http", P2.port)], [ep(HOST)])
        self.wait_backends("prefill", {self.url(P1): False, self.url(P2): False})
        # P1 terminating (still serving): drained, not cut.
        self.api.put_slice(NS, "vllm-prefill-a", svc, [("http", P1.port)],
                           [ep(HOST, ready=False, serving=True, terminating=True)])
        self.wait_backends("prefill", {self.url(P1): True, self.url(P2): False})
        n1 = len(P1.requests)
        for _ in range(4):
            r = http_request(px.port, "POST", "/v1/completions", completion_body())
            self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(P1.requests), n1, "a terminating endpoint took new requests")
        # Not ready and not terminating: not a member; a deleted slice: gone.
        self.api.put_slice(NS, "vllm-prefill-b", svc, [("http", P2.port)],
                           [ep(HOST, ready=False, serving=False)])
        self.api.delete_slice(NS, "vllm-prefill-a")
        self.wait_backends("prefill", {})
        self.api.put_slice(NS, "vllm-prefill-b", svc, [("http", P2.port)], [ep(HOST)])
        self.wait_backends("prefill", {self.url(P2): False})
        self.assertEqual(self.api.lists, 2, "one list per source, no more")

    def test_dropped_watch_410_and_rotated_token(self):
        svc = {"kubernetes.io/service-name": "pre"}
        D = self.mock(decode_handler(), "D")
        self.api.put_slice(NS, "pre-1", svc, [("http", 7001)], [ep("127.0.0.2")])
        self.api.put_slice(NS, "dec-1", {"kubernetes.io/service-name": "dec"}, [("http", D.port)],
                           [ep(HOST)])
        self.proxy(["k8s://%s/pre" % NS], ["k8s://%s/dec" % NS])
        self.wait_backends("prefill", {"http://127.0.0.2:7001": False})
        self.assertTrue(wait_until(lambda: len(self.api.watches) >= 2, 5, 0.01))
        lists = self.api.lists
        # A watch cut off: resumed from the last version seen, no re-list.
        w = len(self.api.watches)
        self.api.drop_watches()
        self.assertTrue(wait_until(lambda: len(self.api.watches) >= w + 2, 10, 0.01),
                        self.api.watches)
        self.assertTrue(all(v > 100 for v in self.api.watches[w:]), self.api.watches)
        self.api.put_slice(NS, "pre-1", svc, [("http", 7001)], [ep("127.0.0.2"), ep("127.0.0.3")])
        self.wait_backends("prefill", {"http://127.0.0.2:7001": False,
                                       "http://127.0.0.3:7001": False})
        self.assertEqual(self.api.lists, lists, "a dropped watch made a re-list")
        # History compacted, then the watch dropped: its version is gone
        # (410), a re-list follows and what changed meanwhile is seen.
        self.api.compact()
        self.api.delete_slice(NS, "pre-1")
        self.api.compact()
        self.api.drop_watches()
        self.assertTrue(wait_until(lambda: self.api.lists >= lists + 2, 10, 0.01),
                        "no re-list after 410 (lists %d)" % self.api.lists)
        self.wait_backends("prefill", {})
        # The token rotated: pdproxy reads the file again for each request.
        self.api.set_token("k8s-token-rotated-abcdef")
        self.api.drop_watches()
        self.assertTrue(wait_until(lambda: self.api.unauthorized >= 1, 10, 0.01))
        with open(self.tokfile + ".new", "w") as f:
            f.write("k8s-token-rotated-abcdef\n")
        os.replace(self.tokfile + ".new", self.tokfile)
        self.api.put_slice(NS, "pre-2", svc, [("http", 7002)], [ep("127.0.0.4")])
        self.wait_backends("prefill", {"http://127.0.0.4:7002": False}, timeout=20)

    def test_1000_endpoints_churning(self):
        D = self.mock(decode_handler(), "D")
        self.api.put_slice(NS, "dec", {"kubernetes.io/service-name": "dec"}, [("http", D.port)],
                           [ep(HOST)])
        svc = {"kubernetes.io/service-name": "big"}
        rnd = random.Random(40)
        ready = {}
        for s in range(10):
            ready[s] = [True] * 100
            self.api.put_slice(NS, "big-%d" % s, svc, [("http", 9000 + s)],
                               [ep("127.1.%d.%d" % (s, i)) for i in range(100)])

        def want():
            return {"http://127.1.%d.%d:%d" % (s, i, 9000 + s): False
                    for s in range(10) for i in range(100) if ready[s][i]}

        def put(s):
            self.api.put_slice(NS, "big-%d" % s, svc, [("http", 9000 + s)],
                               [ep("127.1.%d.%d" % (s, i), ready=ready[s][i]) for i in range(100)])
        px = self.proxy(["k8s://%s/big" % NS], ["k8s://%s/dec" % NS], extra=["--threads", "1"])
        self.wait_backends("prefill", want(), timeout=20)
        # Churn for 5 s: every 10 ms a slice changes 10 of its endpoints.
        cpu0, t0, changes = cpu_seconds(px.proc.pid), time.monotonic(), 0
        while time.monotonic() - t0 < 5.0 and changes < 2000:
            s = rnd.randrange(10)
            for i in rnd.sample(range(100), 10):
                ready[s][i] = not ready[s][i]
            put(s)
            changes += 1
            time.sleep(0.01)
        wall = time.monotonic() - t0
        self.wait_backends("prefill", want(), timeout=30)
        cpu = cpu_seconds(px.proc.pid) - cpu0
        # From one slice change to the routing change, 20 times.
        lat = []
        for k in range(20):
            s = k % 10
            ready[s][k] = not ready[s][k]
            u = "http://127.1.%d.%d:%d" % (s, k, 9000 + s)
            t = time.monotonic()
            put(s)
            self.assertTrue(wait_until(lambda: (u in self.backends("prefill")) == ready[s][k],
                                       10, 0.001))
            lat.append((time.monotonic() - t) * 1000)
        print("k8s discovery: 1,000 endpoints, %d slice changes in %.1f s (%.0f/s, 10 endpoints "
              "each): pdproxy CPU %.2f s (%.0f %% of one core); change -> routing: median %.1f ms, "
              "max %.1f ms (20 changes, admin API polled every 1 ms)"
              % (changes, wall, changes / wall, cpu, 100 * cpu / wall,
                 statistics.median(lat), max(lat)))


if __name__ == "__main__":
    main()
