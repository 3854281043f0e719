#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""engine-sim with the connector's security settings: the cluster secret
(--kv-secret-file, KVC_SECRET_FILE), the publication token in
kv_transfer_params, and heterogeneous TP (--tp-size 1->2 and 2->1: prefill
frees the blocks only after every decode rank's notification).  Real
processes on 127.0.0.1, UCX over tcp; prefill and decode asked directly, as
the proxy would."""
import json
import os
import re
import subprocess
import tempfile
import threading
import unittest

from pdharness.client import post_json
from pdharness.cluster import ClusterCase
from pdharness.net import free_port, wait_for
from pdharness.procs import BIN_DIR, ENGINE_SIM, Proc, start_engine_sim
from pdharness.prom import prom_values

PROMPT = "a b c d e f g h i j k l m n o p q r"  # 2 blocks of 16 tokens


def secret_file(text):
    fd, path = tempfile.mkstemp(prefix="kvc-secret-")
    os.write(fd, text.encode() + b"\n")  # a trailing newline, as a Kubernetes Secret has
    os.close(fd)
    return path


class SimSecurityTest(ClusterCase):
    def setUp(self):
        super().setUp()
        self.files = []
        self.env = {"KVC_SECRET": "", "KVC_SECRET_FILE": ""}

    def tearDown(self):
        super().tearDown()
        for f in self.files:
            os.unlink(f)

    def secret(self, text):
        self.files.append(secret_file(text))
        return self.files[-1]

    def pd(self, p_extra, d_extra, p_env=None, d_env=None):
        p = self.start(start_engine_sim("prefill", p_extra, env=dict(self.env, **(p_env or {}))))
        d = self.start(start_engine_sim("decode", d_extra, env=dict(self.env, **(d_env or {}))))
        return p, d

    def request(self, p, d, rid):
        st, _, raw = post_json(p.port, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
            headers={"X-Request-Id": rid})
        self.assertEqual(st, 200, raw)
        kvp = json.loads(raw)["kv_transfer_params"]
        self.assertRegex(kvp["remote_kv_token"], r"^[0-9a-f]{32}$")
        st, _, raw = post_json(d.port, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": kvp},
            headers={"X-Request-Id": rid})
        self.assertEqual(st, 200, raw)
        return kvp

    def released(self, p, n):
        wait_for(lambda: (prom_values(p.port)["engine_sim_kv_blocks_released_by_consumer_total"]
                          == n, None), 10, "%d blocks released by notification" % n)

    def test_secret_file_both_sides(self):
        f = self.secret("cluster-secret-A")
        p, d = self.pd(["--kv-secret-file", f], [], d_env={"KVC_SECRET_FILE": f})
        kvp = self.request(p, d, "req-s1")
        self.released(p, 2)
        self.assertIn("kv fetch done", d.log())
        self.assertEqual(prom_values(d.port)["engine_sim_kv_fetch_failures_total"], 0)
        self.assertNotIn("NOT authenticated", p.log() + d.log())
        # Two publications never share a token.
        kvp2 = self.request(p, d, "req-s2")
        self.assertNotEqual(kvp["remote_kv_token"], kvp2["remote_kv_token"])
        self.released(p, 4)

    def test_secret_mismatch_recomputes(self):
        p, d = self.pd(["--kv-secret-file", self.secret("secret-one")],
                       ["--kv-secret-file", self.secret("secret-two")])
        self.request(p, d, "req-m1")  # still answered: decode recomputes
        self.assertEqual(prom_values(d.port)["engine_sim_kv_fetch_failures_total"], 1)
        self.assertIn("KVC_ERR_AUTH", d.log())
        self.assertRegex(p.log(), re.compile("authentication failed", re.I))
        self.assertEqual(prom_values(p.port)["engine_sim_kv_blocks_released_by_consumer_total"], 0)

    def test_bad_secret_file_refuses_to_start(self):
        for path in ("/nonexistent/kvc-secret", self.secret("")):
            port = free_port()
            proc = Proc("engine-sim-bad", [ENGINE_SIM, "--port", str(port),
                                           "--kv-secret-file", path], env=self.env)
            self.assertNotEqual(proc.proc.wait(timeout=10), 0)
            self.assertIn("--kv-secret-file", proc.log())
            os.unlink(proc.log_path)

    def test_tp_1_to_2(self):
        f = self.secret("tp-secret")
        p, d = self.pd(["--kv-secret-file", f, "--tp-size", "1"],
                       ["--kv-secret-file", f, "--tp-size", "2"])
        self.request(p, d, "req-t12")
        self.released(p, 2)  # after both decode ranks' notifications
        m = prom_values(p.port)
        self.assertEqual(m["engine_sim_kv_unknown_notifications_total"], 0)
        self.assertEqual(m["engine_sim_kv_blocks_expired_total"], 0)

    def test_tp_2_to_1(self):
        f = self.secret("tp-secret")
        p, d = self.pd(["--kv-secret-file", f, "--tp-size", "2"],
                       ["--kv-secret-file", f, "--tp-size", "1"])
        kvp = self.request(p, d, "req-t21")
        self.assertEqual(kvp["tp_size"], 2)
        self.released(p, 2)
        self.assertEqual(prom_values(p.port)["engine_sim_kv_unknown_notifications_total"], 0)

    def test_tp_fan_in_waits(self):
        # One notification from a TP-2 decode rank whose sibling never
        # notifies: the blocks stay pinned until expiry, never freed by the
        # first notification alone.
        f = self.secret("tp-secret")
        p = self.start(start_engine_sim("prefill", ["--kv-secret-file", f,
                                                    "--kv-expiry-ms", "1500"], env=self.env))
        st, _, raw = post_json(p.port, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
            headers={"X-Request-Id": "req-fan"})
        self.assertEqual(st, 200, raw)
        kvp = json.loads(raw)["kv_transfer_params"]
        hostile = os.path.join(BIN_DIR, "kvc_hostile")
        r = subprocess.run([hostile, "consumer", str(kvp["remote_port"]), "notify",
                            kvp["remote_request_id"], kvp["remote_kv_token"], "2"],
                           capture_output=True, text=True, timeout=20,
                           env=dict(os.environ, UCX_TLS="tcp,self", KVC_SECRET="tp-secret"))
        self.assertIn("NOTIFY sent", r.stdout, r.stderr)
        wait_for(lambda: (prom_values(p.port)["engine_sim_kv_blocks_expired_total"] == 2,
                          None), 10, "expiry")
        m = prom_values(p.port)
        self.assertEqual(m["engine_sim_kv_blocks_released_by_consumer_total"], 0)
        self.assertEqual(m["engine_sim_kv_unknown_notifications_total"], 0)

    def queued_decode(self, d_lease):
        """Two requests through a decode whose KV pool holds one prompt: the
        second waits in decode's queue for ~2.5 s, longer than prefill's
        0.8 s lease.  Returns (prefill metrics, decode metrics)."""
        p = self.start(start_engine_sim("prefill", ["--kv-lease-ms", "800"], env=self.env))
        d = self.start(start_engine_sim("decode", ["--kv-lease-ms", d_lease, "--num-blocks", "2",
                                                   "--itl-ms", "100"], env=self.env))
        kvps = []
        for rid in ("lease-a", "lease-b"):
            st, _, raw = post_json(p.port, "/v1/completions", {
                "prompt": PROMPT, "max_tokens": 1, "stream": False,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
                headers={"X-Request-Id": rid})
            self.assertEqual(st, 200, raw)
            kvps.append(json.loads(raw)["kv_transfer_params"])
        results = {}

        def decode(i):
            results[i] = post_json(d.port, "/v1/completions", {
                "prompt": PROMPT, "max_tokens": 25, "kv_transfer_params": kvps[i]},
                headers={"X-Request-Id": "lease-%d" % i}, timeout=30)

        first = threading.Thread(target=decode, args=(0,))
        first.start()
        wait_for(lambda: (prom_values(d.port)["engine_sim_kv_blocks_free"] == 0, None), 10,
                 "the first decode holding the pool")
        second = threading.Thread(target=decode, args=(1,))
        second.start()
        first.join(30)
        second.join(30)
        for i in (0, 1):
            self.assertEqual(results[i][0], 200, results[i])
        return prom_values(p.port), prom_values(d.port)

    def test_queued_decode_renews_lease(self):
        pm, dm = self.queued_decode("800")
        self.assertGreaterEqual(dm["engine_sim_kv_lease_renewals_total"], 3)
        self.assertEqual(pm["engine_sim_kv_blocks_expired_total"], 0)
        self.assertEqual(dm["engine_sim_kv_fetch_failures_total"], 0)
        wait_for(lambda: (prom_values(self.procs[0].port)
                          ["engine_sim_kv_blocks_released_by_consumer_total"] == 4, None), 10,
                 "both publications released by their consumers")

    def test_unrenewed_lease_expires_while_queued(self):
        # The same without renewals: the queued request's blocks go after
        # the lease, its fetch fails and decode recomputes the prompt.
        pm, dm = self.queued_decode("0")
        self.assertEqual(dm["engine_sim_kv_lease_renewals_total"], 0)
        self.assertEqual(pm["engine_sim_kv_blocks_expired_total"], 2)
        self.assertEqual(dm["engine_sim_kv_fetch_failures_total"], 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
