#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Two pdproxy replicas in front of the same engine-sims (each publishing
its KV-cache events as vLLM does, on a loopback address of its own with
one shared events port) agree: the same requests, sent to one replica and
then the other, go to the same prefill engine every time, because both
index the same events and kv_aware breaks ties deterministically. The
test checks agreement, not which engine: kv_aware's scoring may change.

Prompts are text; pdproxy has their exact tokens from the engines'
POST /tokenize, as kv_aware does in production."""

import http.client
import json
import time
import unittest

from pdharness.net import free_port, wait_until
from pdharness.procs import ENGINE_SIM, SANITIZER_RE, Proc
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom

from test_kv_events import port_free_on

BS = 4
HOSTS = ("127.0.0.2", "127.0.0.3")


def healthy(host, port):
    try:
        c = http.client.HTTPConnection(host, port, timeout=1)
        c.request("GET", "/health")
        ok = c.getresponse().status == 200
        c.close()
        return ok
    except OSError:
        return False


class KvReplicasTest(ProdCase):
    def sim(self, role, host, extra=()):
        port = free_port()
        p = Proc("engine-sim-%s-%d" % (role, port),
                 [ENGINE_SIM, "--role", role, "--port", str(port), "--host", host,
                  "--kv-host", host, "--num-blocks", "4096", "--layers", "2",
                  "--block-bytes", "4096", "--block-tokens", str(BS)] + list(extra))
        self.addCleanup(self.stop_sim, p)
        self.assertTrue(wait_until(lambda: healthy(host, port) or not p.alive(), 15.0))
        self.assertTrue(p.alive(), p.log())
        return host, port

    def stop_sim(self, p):
        was_up = p.alive()
        rc = p.stop()
        san = SANITIZER_RE.search(p.log())
        self.assertIsNone(san, san and san.group(0))
        if was_up:
            self.assertEqual(rc, 0, "%s exited with %s" % (p.name, rc))

    def chosen(self, px, prefills):
        s = prom(px.port)
        return [metric(s, "pdproxy_upstream_requests_total", role="prefill",
                       backend="%s:%d" % b, outcome="ok") or 0 for b in prefills]

    def indexes(self, pxs, prefills):
        return [tuple(metric(prom(px.port), "pdproxy_kv_index_blocks", backend="%s:%d" % b)
                      for b in prefills) for px in pxs]

    def settle(self, pxs, prefills):
        """Until both replicas index the same blocks, unchanged for 0.3 s."""
        st = {"last": None, "since": time.monotonic()}

        def steady():
            cur = self.indexes(pxs, prefills)
            if cur[0] != cur[1] or cur != st["last"]:
                st["last"], st["since"] = cur, time.monotonic()
                return False
            return time.monotonic() - st["since"] >= 0.3

        if not wait_until(steady, 10.0, 0.05):
            self.fail("replica indexes did not settle: %s" % (st["last"],))
        return st["last"]

    def test_replicas_route_the_same(self):
        for _ in range(20):
            evp = free_port()
            if port_free_on(HOSTS, evp):
                break
        prefills = [self.sim("prefill", h, ["--kv-events-endpoint", "tcp://%s:%d" % (h, evp)])
                    for h in HOSTS]
        decode = self.sim("decode", "127.0.0.1")
        pxs = [self.start(prefill=prefills, decode=[decode],
                          extra=["--prefill-policy", "kv_aware", "--kv-events-port", str(evp),
                                 "--tokenize-timeout", "5"])
               for _ in range(2)]
        # Both replicas subscribed before any event is published.
        for px in pxs:
            st = wait_until(lambda: all(
                metric(prom(px.port), "pdproxy_kv_index_blocks", backend="%s:%d" % b) is not None
                for b in prefills), 10.0)
            self.assertTrue(st)
        # ZeroMQ's subscription handshake ends after the connect, and nothing
        # says when: pdproxy watches its sockets only for disconnects and
        # engine-sim's PUB socket hears no subscriptions. A batch missed for
        # want of it would show below (a sequence gap), so it gets 0.5 s.
        time.sleep(0.5)
        # Four families of prompts sharing 8-block prefixes, each asked
        # three times with different tails, interleaved.
        prompts = []
        for k in range(3):
            for f in range(4):
                prompts.append(" ".join(["fam%d_%d" % (f, i) for i in range(8 * BS)] +
                                        ["tail%d_%d_%d" % (f, k, i) for i in range(2 * BS + 1)]))
        seen = [[], []]
        for t in prompts:
            for r, px in enumerate(pxs):
                before = self.chosen(px, prefills)
                resp = self.post(px, json.dumps({"model": "sim-model", "prompt": t,
                                                 "max_tokens": 2}).encode(),
                                 headers=[("Content-Type", "application/json")])
                self.assertEqual(resp.status, 200, resp.body)
                after = self.chosen(px, prefills)
                diff = [a - b for a, b in zip(after, before)]
                self.assertEqual(sorted(diff), [0, 1], diff)
                seen[r].append(diff.index(1))
                self.settle(pxs, prefills)
        self.assertEqual(seen[0], seen[1])
        for x in (prom(px.port) for px in pxs):
            self.assertEqual(metric(x, "pdproxy_tokenize_total", result="ok"), len(prompts))
        # The index fed the choices: the engines' blocks are in both.
        idx = self.settle(pxs, prefills)
        self.assertGreater(sum(idx[0]), 0)
        s = [prom(px.port) for px in pxs]
        for x in s:
            self.assertEqual(metric(x, "pdproxy_kv_event_gaps_total"), 0)
            self.assertEqual(metric(x, "pdproxy_kv_index_resets_total"), 0)


if __name__ == "__main__":
    unittest.main()
