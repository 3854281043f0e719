#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Failures around a transfer, with vLLM's kv_load_failure_policy on decode:
leases renewed while a decode request waits in the queue (blocks kept past
the lease), leases not renewed (blocks freed; decode fails or recomputes),
prefill dying after it answered (fail / recompute), decode dying while its
request waits (prefill gets its blocks back by the lease)."""
import concurrent.futures
import time
import unittest

import harness
from harness import Engine, decode, prefill, prompt_of

harness.need_torch()
LEASE = ["--lease-ms", "1000"]


class Faults(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.procs = []
        try:
            cls.p = cls.start("P", LEASE)
            cls.d_renew = cls.start("Drenew", ["--renew-s", "0.3"])
            cls.d_fail = cls.start("Dfail", ["--renew-s", "1000"])
            cls.d_rec = cls.start("Drec", ["--renew-s", "1000", "--policy", "recompute"])
        except Exception:
            cls.tearDownClass()
            raise

    @classmethod
    def start(cls, name, args):
        e = Engine(name, args=args)
        cls.procs.append(e)
        return e

    @classmethod
    def tearDownClass(cls):
        for e in cls.procs:
            e.stop()

    def queued(self, d, prompt, kv, rid, hold_s, expires=False):
        """decode with allocation paused for hold_s (the request waits in the
        queue, get_num_new_matched_tokens asked every step). expires: the
        lease is to run out within hold_s, so the hold ends when prefill
        has its blocks back (at most hold_s)."""
        d.call("POST", "/test/pause", {"on": True})
        pool = concurrent.futures.ThreadPoolExecutor(1)
        fut = pool.submit(decode, d, prompt, kv, rid)
        try:
            d.wait_state(lambda s: s["waiting"] >= 1)
            if expires:
                published = self.p.wait_state(lambda s: s["published_now"] == 0,
                                              hold_s)["published_now"]
            else:
                time.sleep(hold_s)  # held past the lease: time is the scenario
                published = self.p.state()["published_now"]
        finally:
            d.call("POST", "/test/pause", {"on": False})
        res = fut.result(timeout=60)
        pool.shutdown()
        return published, res

    def settle_p(self):
        return self.p.wait_state(lambda s: s["published_now"] == 0 and
                                 s["free_blocks"] == s["num_blocks"])

    def test_1_lease_renewed_while_queued(self):
        prompt = prompt_of(1)
        kv, first = prefill(self.p, prompt, "lr")
        published, (st, r) = self.queued(self.d_renew, prompt, kv, "lr", 2.0)
        self.assertEqual(published, 1)  # held twice the lease
        self.assertEqual(st, 200, r)
        self.assertEqual(r["choices"][0]["text"].split()[0], first.strip())
        self.assertEqual(self.d_renew.state()["verified"], 1)
        self.settle_p()
        # the renewals in vLLM's metrics, on both sides
        self.assertGreaterEqual(self.d_renew.metric("vllm:pdkv_num_lease_renewals_sent_total"), 2)
        self.assertGreaterEqual(self.p.metric("vllm:pdkv_num_lease_renewals_accepted_total"), 2)

    def test_2_lease_expired_fail(self):
        prompt = prompt_of(2)
        kv, _ = prefill(self.p, prompt, "lf")
        published, (st, r) = self.queued(self.d_fail, prompt, kv, "lf", 2.0, expires=True)
        self.assertEqual(published, 0)  # expired: blocks back to prefill
        self.assertEqual(self.settle_p()["free_blocks"], self.p.state()["num_blocks"])
        self.assertGreaterEqual(self.p.metric("vllm:pdkv_num_kv_expired_reqs_total"), 1)
        self.assertEqual(st, 500, r)
        self.assertEqual(self.d_fail.state()["load_failed"], 1)

    def test_3_lease_expired_recompute(self):
        prompt = prompt_of(3)
        kv, first = prefill(self.p, prompt, "lc")
        published, (st, r) = self.queued(self.d_rec, prompt, kv, "lc", 2.0, expires=True)
        self.assertEqual(published, 0)
        self.assertEqual(st, 200, r)
        # recomputed locally: the same model, the same first token
        self.assertEqual(r["choices"][0]["text"].split()[0], first.strip())
        s = self.d_rec.state()
        self.assertEqual((s["load_failed"], s["recomputed"]), (1, 1), s)

    def test_4_prefill_dies(self):
        p2 = Engine("P2")
        try:
            kvs = [prefill(p2, prompt_of(i), "pd%d" % i) for i in (4, 5)]
        finally:
            p2.kill()
            p2.stop()
        st, r = decode(self.d_fail, prompt_of(4), kvs[0][0], "pd4")
        self.assertEqual(st, 500, r)
        st, r = decode(self.d_rec, prompt_of(5), kvs[1][0], "pd5")
        self.assertEqual(st, 200, r)
        self.assertEqual(r["choices"][0]["text"].split()[0], kvs[1][1].strip())

    def test_5_decode_dies_while_waiting(self):
        prompt = prompt_of(6)
        d = Engine("Ddie", args=["--renew-s", "0.3"])
        kv, _ = prefill(self.p, prompt, "dd")
        try:
            d.call("POST", "/test/pause", {"on": True})
            pool = concurrent.futures.ThreadPoolExecutor(1)
            fut = pool.submit(decode, d, prompt, kv, "dd")
            renewed = self.p.metric("vllm:pdkv_num_lease_renewals_accepted_total")
            d.wait_state(lambda s: s["waiting"] >= 1)
            # Renewing: five renewals 0.3 s apart span 1.2 s, past the blocks'
            # 1 s lease.
            self.assertGreaterEqual(harness.wait_value(
                lambda: self.p.metric("vllm:pdkv_num_lease_renewals_accepted_total"),
                lambda n: n >= renewed + 5, 10.0, 0.05), renewed + 5)
            self.assertEqual(self.p.state()["published_now"], 1)
        finally:
            d.kill()
            d.stop()
        with self.assertRaises(OSError):
            fut.result(timeout=30)
        pool.shutdown()
        # no more renewals: prefill frees the blocks when the lease runs out
        ps = self.settle_p()
        self.assertEqual((ps["published_now"], ps["free_blocks"]), (0, ps["num_blocks"]), ps)
        # and keeps serving
        kv, first = prefill(self.p, prompt, "dd2")
        st, r = decode(self.d_renew, prompt, kv, "dd2")
        self.assertEqual(st, 200, r)


if __name__ == "__main__":
    unittest.main(verbosity=2)
