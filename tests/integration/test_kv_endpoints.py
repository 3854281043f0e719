#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Per-backend KV-event endpoints (issue 24): a config entry's
kv_events_endpoint / kv_events_replay_endpoint and POST /admin/backends'
fields of the same names say where that engine publishes, over what
--kv-events-port derives from its address. engine-sim publishes on ports
(and an ipc:// path) that have nothing to do with its HTTP port; the index
fills from them (GET /admin/kv_index) and kv_aware routes on it; a reload
that changes one backend's endpoint re-subscribes that one alone; bad
endpoints are refused at start, at reload (the running config stays) and
by the admin API (400 JSON)."""

import json
import os

from pdharness.client import http_request
from pdharness.ctl import admin, tmpdir, token_file, write_yaml
from pdharness.net import HOST, free_port, wait_value
from pdharness.procs import run_pdproxy, start_engine_sim
from pdharness.prod import ProdCase

BS = 4
BAD = ("tcp://127.0.0.1", "tcp://*:5557", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000",
       "http://127.0.0.1:5557", "tcp://:5557", "tcp://[::1:5557", "ipc://", "tcp://a b:1")


def words(salt, n=18):
    return " ".join("%s%d" % (salt, i) for i in range(n))


class KvEndpointsTest(ProdCase):
    def setUp(self):
        super().setUp()
        self.dir = tmpdir(self)
        self.file = os.path.join(self.dir, "pdproxy.yaml")
        self.tokpath, self.token = token_file(self, self.dir)

    def sim(self, ep=None, role="both"):
        args = ["--block-tokens", str(BS)]
        if ep:
            args += ["--kv-events-endpoint", ep]
        p = start_engine_sim(role, args)
        self.addCleanup(p.stop)
        return p

    def entry(self, sim, ep=None):
        u = "http://%s:%d" % (HOST, sim.port)
        return json.dumps({"url": u, "kv_events_endpoint": ep} if ep else u)

    def write(self, prefill, decode, extra=""):
        write_yaml(self.file, "prefill: [%s]\ndecode: [%s]\nprefill-policy: kv_aware\n"
                   "tokenize-timeout: 5\n%s" % (", ".join(prefill), ", ".join(decode), extra))

    def start_px(self, extra=()):
        self.aport = free_port()
        return self.start(args=["--config", self.file, "--admin-port", str(self.aport),
                                "--admin-token-file", self.tokpath] + list(extra))

    def call(self, method, path, body=None):
        return admin(self.aport, method, path, body, self.token)

    def subs(self):
        st, doc = self.call("GET", "/admin/kv_index")
        self.assertEqual(st, 200, doc)
        return {b["backend"]: b for b in doc["backends"]}

    def bn(self, sim):
        return "%s:%d" % (HOST, sim.port)

    def connected(self, sim, name):
        """Resets sim's prefix cache (one AllBlocksCleared batch each) until
        batch reaches the subscription `name` (more than it had): ZeroMQ
        drops what is published before a subscriber has joined."""
        base = self.subs().get(name, {}).get("batches", 0)

        def got():
            http_request(sim.port, "POST", "/reset_prefix_cache", b"{}")
            return self.subs().get(name, {}).get("batches", 0)
        n = wait_value(got, lambda v: v > base, 10.0, interval=0.1)
        self.assertGreater(n, base, "no KV event batch of %s reached pdproxy" % name)

    def complete(self, port, prompt):
        r = http_request(port, "POST", "/v1/completions",
                         json.dumps({"model": "sim-model", "prompt": prompt,
                                     "max_tokens": 1}).encode(),
                         [("Content-Type", "application/json")])
        self.assertEqual(r.status, 200, r.body)

    def wait_blocks(self, name, pred, what):
        got = wait_value(lambda: self.subs().get(name, {}).get("blocks"), pred, 10.0)
        self.assertTrue(pred(got), "%s: blocks %r, wanted %s" % (name, got, what))

    def prefills(self):
        st, doc = self.call("GET", "/admin/backends")
        self.assertEqual(st, 200, doc)
        return {b["backend"]: b["requests"]["ok"] for b in doc["backends"]
                if b["role"] == "prefill"}

    def test_entries_endpoints_fill_the_index_and_route(self):
        ep0 = "tcp://%s:%d" % (HOST, free_port())
        ep1 = "ipc://%s/kv1.ipc" % self.dir
        P0, P1, D = self.sim(ep0), self.sim(ep1), self.sim()
        self.write([self.entry(P0, ep0), self.entry(P1, ep1)], [self.entry(D)])
        # No --kv-events-port: the entries alone turn the subscriber on.
        px = self.start_px()
        subs = self.subs()
        self.assertEqual(set(subs), {self.bn(P0), self.bn(P1)})
        self.assertEqual(subs[self.bn(P0)]["endpoint"], ep0)
        self.assertEqual(subs[self.bn(P1)]["endpoint"], ep1)
        self.assertEqual(subs[self.bn(P0)]["endpoint_from"], "file")
        st, doc = self.call("GET", "/admin/backends")
        self.assertEqual({b["backend"]: b["kv_events_endpoint"] for b in doc["backends"]},
                         {self.bn(P0): ep0, self.bn(P1): ep1, self.bn(D): None})
        self.connected(P0, self.bn(P0))
        self.connected(P1, self.bn(P1))
        # Each engine computes its own prompt: its index fills, the other's not.
        self.complete(P0.port, words("a"))
        self.complete(P1.port, words("b"))
        self.wait_blocks(self.bn(P0), lambda v: v == 4, "4")
        self.wait_blocks(self.bn(P1), lambda v: v == 4, "4")
        # kv_aware sends each prompt to the engine that holds it.
        for _ in range(3):
            self.complete(px.port, words("a") + " x")
        self.assertEqual(self.prefills(), {self.bn(P0): 3, self.bn(P1): 0})
        for _ in range(3):
            self.complete(px.port, words("b") + " y")
        self.assertEqual(self.prefills(), {self.bn(P0): 3, self.bn(P1): 3})

    def test_admin_add_with_endpoint(self):
        ep1 = "tcp://%s:%d" % (HOST, free_port())
        P0, P1, D = self.sim(), self.sim(ep1), self.sim()
        self.write([self.entry(P0)], [self.entry(D)])
        # The flag's port for P0: nothing publishes there.
        px = self.start_px(["--kv-events-port", str(free_port())])
        self.assertEqual(self.subs()[self.bn(P0)]["endpoint_from"], "flag")
        u1 = "http://%s:%d" % (HOST, P1.port)
        for bad in BAD + (5, None, ["tcp://127.0.0.1:1"]):
            for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
                st, doc = self.call("POST", "/admin/backends",
                                    {"role": "prefill", "url": u1, key: bad})
                self.assertEqual(st, 400, (key, bad, doc))
                self.assertIn(key, doc["error"]["message"])
                self.assertLessEqual({"message", "type", "code"}, set(doc["error"]))
        self.assertNotIn(self.bn(P1), self.prefills(), "a refused add added it")
        st, doc = self.call("POST", "/admin/backends",
                            {"role": "prefill", "url": u1, "kv_events_endpoint": ep1})
        self.assertEqual(st, 201, doc)
        name = self.bn(P1)
        wait_value(lambda: name in self.subs(), bool, 5.0)
        sub = self.subs()[name]
        self.assertEqual((sub["endpoint"], sub["endpoint_from"]), (ep1, "admin"))
        self.connected(P1, name)
        self.complete(P1.port, words("c"))
        self.wait_blocks(name, lambda v: v == 4, "4")
        for _ in range(2):
            self.complete(px.port, words("c") + " z")
        self.assertEqual(self.prefills(), {self.bn(P0): 0, name: 2})
        # Removed: its subscription goes; added again without: the flag's.
        st, doc = self.call("DELETE", "/admin/backends", {"role": "prefill", "url": u1})
        self.assertEqual(st, 200, doc)
        wait_value(lambda: name not in self.subs(), bool, 5.0)
        self.assertNotIn(name, self.subs())
        st, doc = self.call("POST", "/admin/backends", {"role": "prefill", "url": u1})
        self.assertEqual(st, 201, doc)
        got = wait_value(lambda: self.subs().get(name, {}).get("endpoint_from"),
                         lambda v: v == "flag", 5.0)
        self.assertEqual(got, "flag")

    def test_admin_endpoint_needs_the_subscriber(self):
        P0, D = self.sim(), self.sim()
        self.write([self.entry(P0)], [self.entry(D)])
        self.start_px()
        st, doc = self.call("POST", "/admin/backends",
                            {"role": "prefill", "url": "http://%s:%d" % (HOST, free_port()),
                             "kv_events_endpoint": "tcp://127.0.0.1:5557"})
        self.assertEqual(st, 400, doc)
        self.assertIn("KV events are off", doc["error"]["message"])

    def test_reload_resubscribes_only_the_changed_backend(self):
        ep0, ep1, ep2 = ("tcp://%s:%d" % (HOST, free_port()) for _ in range(3))
        P0, P1, P2, D = self.sim(ep0), self.sim(ep1), self.sim(ep2), self.sim()
        self.write([self.entry(P0, ep0), self.entry(P1, ep1)], [self.entry(D)])
        self.start_px()
        n0, n1 = self.bn(P0), self.bn(P1)
        self.connected(P0, n0)
        self.connected(P1, n1)
        self.complete(P0.port, words("d"))
        self.complete(P1.port, words("e"))
        self.wait_blocks(n0, lambda v: v == 4, "4")
        self.wait_blocks(n1, lambda v: v == 4, "4")
        before = self.subs()
        # A bad endpoint: the reload is refused and nothing changes.
        for bad in BAD:
            self.write([self.entry(P0, bad), self.entry(P1, ep1)], [self.entry(D)])
            st, doc = self.call("POST", "/admin/reload")
            self.assertEqual(st, 400, (bad, doc))
            self.assertIn("kv_events_endpoint", doc["error"]["message"])
        self.assertEqual(self.subs(), before)
        # P0's entry now names P2's publisher: P0's index is dropped and
        # fills from there; P1's subscription is left alone.
        self.write([self.entry(P0, ep2), self.entry(P1, ep1)], [self.entry(D)])
        st, doc = self.call("POST", "/admin/reload")
        self.assertEqual(st, 200, doc)
        got = wait_value(lambda: self.subs()[n0]["endpoint"], lambda v: v == ep2, 5.0)
        self.assertEqual(got, ep2)
        after = self.subs()
        self.assertEqual(after[n0]["blocks"], 0)
        self.assertEqual(after[n0]["resets"], before[n0]["resets"] + 1)
        self.assertEqual({k: after[n1][k] for k in ("endpoint", "blocks", "resets", "batches")},
                         {k: before[n1][k] for k in ("endpoint", "blocks", "resets", "batches")})
        self.connected(P2, n0)
        self.complete(P2.port, words("f"))
        self.wait_blocks(n0, lambda v: v == 4, "4")
        self.assertEqual(self.subs()[n1]["blocks"], 4)

    def test_bad_entries_refused_at_start_and_print_config_reads_back(self):
        for bad in BAD:
            for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
                write_yaml(self.file, "prefill: [{url: 'http://127.0.0.1:1', %s: '%s'}]\n"
                           "decode: [http://127.0.0.1:2]\n" % (key, bad))
                p = run_pdproxy(["--config", self.file, "--print-config"])
                self.assertNotEqual(p.returncode, 0, bad)
                self.assertIn("%s:1: key 'prefill': %s '%s'" % (self.file, key, bad), p.stderr)
        write_yaml(self.file, "prefill: [{url: 'http://127.0.0.1:1', kv_events_endpoint: "
                   "'tcp://10.0.0.1:5557', kv_events_endpoint: 'tcp://10.0.0.1:5558'}]\n"
                   "decode: [http://127.0.0.1:2]\n")
        p = run_pdproxy(["--config", self.file, "--print-config"])
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("each once", p.stderr)
        write_yaml(self.file, "prefill: [{url: 'http://127.0.0.1:1', dp_size: 2, "
                   "kv_events_endpoint: 'tcp://[::1]:5557', kv_events_replay_endpoint: "
                   "'ipc:///run/kv.ipc'}, http://127.0.0.1:3]\ndecode: [http://127.0.0.1:2]\n")
        p = run_pdproxy(["--config", self.file, "--print-config"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn('prefill: [{url: "http://127.0.0.1:1", dp_size: 2, kv_events_endpoint: '
                      '"tcp://[::1]:5557", kv_events_replay_endpoint: "ipc:///run/kv.ipc"}, '
                      '"http://127.0.0.1:3"]', p.stdout)
        write_yaml(self.file, p.stdout)
        again = run_pdproxy(["--config", self.file, "--print-config"])
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertEqual(again.stdout, p.stdout)


if __name__ == "__main__":
    import unittest
    unittest.main(verbosity=2)
