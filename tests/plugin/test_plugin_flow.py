#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PdkvConnector between two engine processes (torch CPU caches): every
transferred block byte-exact (checked by decode when its load ends, against
the prompt's KV), blocks never allocated untouched, prefill's blocks back in
its pool once decode notified; UCX over tcp and over shared memory; a wrong
token; a decode request aborted before its transfer; 200 concurrent
requests with no publication left behind."""
import concurrent.futures
import sys
import time
import unittest

import harness
from harness import Engine, decode, prefill, prompt_of

harness.need_torch()


class Pair:
    def __init__(self, tls, layers=3):
        env = {"UCX_TLS": tls}
        args = ["--layers", str(layers)]
        self.p = Engine("P", env=env, args=args)
        self.d = Engine("D", env=env, args=args)

    def stop(self):
        self.p.stop()
        self.d.stop()

    def settled(self, test, verified):
        ps = self.p.wait_state(lambda s: s["free_blocks"] == s["num_blocks"] and
                               s["published_now"] == 0)
        test.assertEqual((ps["free_blocks"], ps["published_now"]), (ps["num_blocks"], 0), ps)
        ds = self.d.wait_state(lambda s: s["free_blocks"] == s["num_blocks"])
        test.assertEqual(ds["free_blocks"], ds["num_blocks"], ds)
        test.assertEqual((ds["verified"], ds["corrupt"]), (verified, 0), ds)
        st, u = self.d.get("/test/untouched")
        test.assertEqual((u["bad"], u["corrupt"]), ([], []), u)
        test.assertGreater(u["never_allocated"], 0)


class Transports(unittest.TestCase):
    def run_flow(self, tls):
        pair = Pair(tls)
        try:
            for i, n in enumerate((5, 16, 17, 95)):
                prompt = prompt_of(i, n)
                kv, first = prefill(pair.p, prompt, "r%d" % i)
                self.assertEqual(kv["remote_port"], pair.p.kv_port)
                self.assertEqual(len(kv["remote_kv_token"]), 32)
                self.assertEqual(len(kv["remote_block_ids"]), (n + 15) // 16)  # computed tokens only
                st, r = decode(pair.d, prompt, kv, "r%d" % i)
                self.assertEqual(st, 200, r)
                # decode's first token is a digest of the prompt's KV in its own
                # blocks: the same as prefill's only if every byte arrived
                self.assertEqual(r["choices"][0]["text"].split()[0], first.strip())
            pair.settled(self, 4)
        finally:
            pair.stop()

    def test_tcp(self):
        self.run_flow("tcp")

    def test_shared_memory(self):
        self.run_flow("sm,self")


class Requests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pair = Pair("tcp", layers=2)

    @classmethod
    def tearDownClass(cls):
        cls.pair.stop()

    def test_1_wrong_token(self):
        prompt = prompt_of(1)
        kv, first = prefill(self.pair.p, prompt, "tok")
        bad = dict(kv, remote_kv_token="0" * 32)
        st, r = decode(self.pair.d, prompt, bad, "tok-bad")
        self.assertEqual(st, 500, r)  # kv_load_failure_policy "fail"
        self.assertEqual(r["error"]["type"], "InternalServerError")
        self.assertEqual(self.pair.d.state()["load_failed"], 1)
        # the wrong token released nothing: the right one still loads
        self.assertEqual(self.pair.p.wait_state(lambda s: s["published_now"] == 1)["published_now"], 1)
        st, r = decode(self.pair.d, prompt, kv, "tok-good")
        self.assertEqual(st, 200, r)
        self.assertEqual(r["choices"][0]["text"].split()[0], first.strip())
        self.pair.p.wait_state(lambda s: s["published_now"] == 0)

    def test_2_abort_before_transfer(self):
        prompt = prompt_of(2)
        kv, _ = prefill(self.pair.p, prompt, "ab")
        self.assertEqual(self.pair.p.wait_state(lambda s: s["published_now"] == 1)["published_now"], 1)
        self.pair.d.call("POST", "/test/pause", {"on": True})
        pool = concurrent.futures.ThreadPoolExecutor(1)
        fut = pool.submit(decode, self.pair.d, prompt, kv, "ab-d")
        try:
            self.pair.d.wait_state(lambda s: s["waiting"] == 1)
            self.assertTrue(self.pair.d.call("POST", "/test/abort", {"request_id": "ab-d"})[1]["aborted"])
        finally:
            self.pair.d.call("POST", "/test/pause", {"on": False})
        st, r = fut.result(timeout=30)
        pool.shutdown()
        self.assertEqual((st, r["choices"][0]["text"]), (200, ""), r)
        # decode told prefill (notification without blocks): freed at once,
        # long before its lease or expiry
        ps = self.pair.p.wait_state(lambda s: s["published_now"] == 0 and
                                    s["free_blocks"] == s["num_blocks"], timeout=5)
        self.assertEqual((ps["published_now"], ps["free_blocks"]), (0, ps["num_blocks"]), ps)

    def test_3_two_hundred_concurrent(self):
        n = 200
        t0 = time.monotonic()
        def one(i):  # what a proxy does per request: prefill, then decode
            kv, first = prefill(self.pair.p, prompt_of(i), "c%d" % i)
            return first, decode(self.pair.d, prompt_of(i), kv, "c%d" % i, max_tokens=2)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            res = list(pool.map(one, range(n)))
        for i, (first, (st, r)) in enumerate(res):
            self.assertEqual(st, 200, r)
            self.assertEqual(r["choices"][0]["text"].split()[0], first.strip(), i)
        ps = self.pair.p.wait_state(lambda s: s["published_now"] == 0 and
                                    s["free_blocks"] == s["num_blocks"])
        self.assertEqual((ps["published_now"], ps["free_blocks"], ps["delayed"]),
                         (0, ps["num_blocks"], 0), ps)
        ds = self.pair.d.wait_state(lambda s: s["free_blocks"] == s["num_blocks"])
        self.assertEqual(ds["corrupt"], 0, ds)
        self.assertGreaterEqual(ds["verified"], n)
        print("200 requests P->D in %.1f s" % (time.monotonic() - t0), file=sys.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
