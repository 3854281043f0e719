#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vLLM's KV layouts through PdkvConnector: FlashAttention per-layer
[2, num_blocks, block_size, heads, head] in HND (K and V planes: two regions
per layer, several layers), MLA [num_blocks, block_size, head]; heterogeneous
TP 1->2 and 2->1 through partial-block reads (each decode rank holds its
heads; prefill ranks on remote_port + rank); NHD with heterogeneous TP is
refused clearly (no head split without HND, as NIXL states)."""
import unittest

import harness
from harness import Engine, decode, prefill, prompt_of

harness.need_torch()


class Layouts(unittest.TestCase):
    def pair(self, ptp, dtp, args=(), dargs=()):
        p = Engine("P", tp=ptp, args=["--layers", "3"] + list(args))
        try:
            d = Engine("D", tp=dtp, args=["--layers", "3"] + list(args) + list(dargs))
        except Exception:
            p.stop()
            raise
        self.addCleanup(p.stop)
        self.addCleanup(d.stop)
        return p, d

    def flow(self, p, d, n=3):
        for i in range(n):
            prompt = prompt_of(i, 10 + 23 * i)
            kv, first = prefill(p, prompt, "l%d" % i)
            st, r = decode(d, prompt, kv, "l%d" % i)
            self.assertEqual(st, 200, (r, d.output()))
        ds = d.wait_state(lambda s: s["free_blocks"] == s["num_blocks"])
        self.assertEqual((ds["verified"], ds["corrupt"], ds["load_failed"]), (n, 0, 0), ds)
        ps = p.wait_state(lambda s: s["published_now"] == 0 and s["free_blocks"] == s["num_blocks"])
        self.assertEqual((ps["published_now"], ps["free_blocks"]), (0, ps["num_blocks"]), ps)
        u = d.get("/test/untouched")[1]
        self.assertEqual((u["bad"], u["corrupt"]), ([], []), u)
        return first

    def test_tp1_to_tp2(self):
        self.flow(*self.pair(1, 2))

    # libkvconnector (connector/, not this suite's) fails a slice into local
    # part j of 2 when the run spans more than one block: KVC_ERR_PROTOCOL
    # "data message does not match the fetch".  test_plugin_lib.py's
    # test_slice_into_local_parts reproduces it with ctypes alone.  Remove the
    # decorator once the library is fixed (an unexpected success fails here).
    @unittest.expectedFailure
    def test_tp2_to_tp1(self):
        self.flow(*self.pair(2, 1))

    def test_tp2_to_tp1_one_block(self):
        # the same path with one-block prompts works today
        p, d = self.pair(2, 1)
        for i in range(2):
            prompt = prompt_of(i, 9 + i)
            kv, first = prefill(p, prompt, "o%d" % i)
            st, r = decode(d, prompt, kv, "o%d" % i)
            self.assertEqual(st, 200, r)
            self.assertEqual(r["choices"][0]["text"].split()[0], first.strip())
        ds = d.wait_state(lambda s: s["verified"] == 2)
        self.assertEqual((ds["verified"], ds["corrupt"]), (2, 0), ds)

    def test_mla(self):
        self.flow(*self.pair(1, 1, args=["--mla", "--head-size", "24"]))

    def test_mla_tp2_to_tp1(self):
        # MLA is replicated: decode reads one prefill rank, notifies both
        self.flow(*self.pair(2, 1, args=["--mla", "--head-size", "24"]))

    def test_nhd_heterogeneous_refused(self):
        p, d = self.pair(1, 2, args=["--nhd"])
        prompt = prompt_of(7)
        kv, _ = prefill(p, prompt, "nhd")
        st, r = decode(d, prompt, kv, "nhd")
        self.assertEqual(st, 500, r)
        self.assertIn("HND", d.output())
        self.assertEqual(d.state()["load_failed"], 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
