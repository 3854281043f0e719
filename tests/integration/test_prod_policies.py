#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 5 item 5, routing policies per role (--prefill-policy /
--decode-policy): round_robin, least_inflight, power_of_two,
prefix_affinity (the prompt's whole block chain, with its bounded-load cap
--prefix-load-factor; prefix_affinity_bytes, the first --prefix-bytes) and
load_aware (engines' /metrics read by load probes every --metrics-interval)."""

import unittest

from pdharness.mocks import (Respond, chat_body, completion_body, decode_handler,
                             engine_metrics_handler, prefill_handler)
from pdharness.net import wait_until
from pdharness.prod import ProdCase


def prompt_body(prefix, suffix, **kw):
    return completion_body(prompt=prefix + suffix, **kw)


class RoundRobinTest(ProdCase):
    def test_round_robin_cycles_both_roles(self):
        P = [self.mock(prefill_handler(), name="P%d" % i) for i in range(3)]
        D = [self.mock(decode_handler(), name="D%d" % i) for i in range(2)]
        px = self.start(P, D, ["--prefill-policy", "round_robin", "--decode-policy",
                               "round_robin"])
        order_p, order_d = [], []
        for i in range(12):
            rid = "rr-%d" % i
            self.assertEqual(self.post(px, headers={"X-Request-Id": rid}).status, 200)
            order_p.append([j for j, m in enumerate(P)
                            if any(r.header("x-request-id") == rid for r in m.requests)])
            order_d.append([j for j, m in enumerate(D)
                            if any(r.header("x-request-id") == rid for r in m.requests)])
        order_p = [o[0] for o in order_p]
        order_d = [o[0] for o in order_d]
        self.assertEqual(order_p, [(order_p[0] + i) % 3 for i in range(12)], order_p)
        self.assertEqual(order_d, [(order_d[0] + i) % 2 for i in range(12)], order_d)


class LoadPoliciesTest(ProdCase):
    """A slow backend (each answer takes 0.6 s) beside a fast one, under a
    steady concurrency of 4: policies that look at load send the slow one
    less than round robin's half."""

    N = 24

    def run_load(self, policy, role):
        if role == "prefill":
            slow = self.mock(prefill_handler(delay=0.6), name="Pslow")
            fast = self.mock(prefill_handler(), name="Pfast")
            D = self.mock(decode_handler(), name="D")
            px = self.start([slow, fast], [D], ["--prefill-policy", policy])
        else:
            P = self.mock(prefill_handler(), name="P")

            def slow_d(req):
                return Respond(200, [("Content-Type", "application/json")], b'{"x":1}', delay=0.6)

            slow = self.mock(slow_d, name="Dslow")
            fast = self.mock(decode_handler(), name="Dfast")
            px = self.start([P], [slow, fast], ["--decode-policy", policy])
        res = self.concurrent(lambda i: self.post(px).status, self.N, workers=4, timeout=40)
        self.assertEqual(res, [200] * self.N)
        return len(slow.requests), len(fast.requests)

    def test_least_inflight_prefill(self):
        s, f = self.run_load("least_inflight", "prefill")
        self.assertEqual(s + f, self.N)
        self.assertLessEqual(s, self.N // 4, "least_inflight sent the slow prefill %d of %d" % (s, self.N))

    def test_least_inflight_decode(self):
        s, f = self.run_load("least_inflight", "decode")
        self.assertLessEqual(s, self.N // 4, "least_inflight sent the slow decode %d of %d" % (s, self.N))

    def test_power_of_two_prefill(self):
        s, f = self.run_load("power_of_two", "prefill")
        self.assertLessEqual(s, self.N // 4, "power_of_two sent the slow prefill %d of %d" % (s, self.N))

    def test_round_robin_does_not_steer(self):
        """The baseline the others are measured against: half and half."""
        s, f = self.run_load("round_robin", "prefill")
        self.assertGreaterEqual(s, self.N // 2 - 2)

    def test_power_of_two_spreads_idle_traffic(self):
        P = [self.mock(prefill_handler(), name="P%d" % i) for i in range(3)]
        D = self.mock(decode_handler(), name="D")
        px = self.start(P, [D], ["--prefill-policy", "power_of_two"])
        for i in range(30):
            self.assertEqual(self.post(px).status, 200)
        counts = [len(m.requests) for m in P]
        self.assertEqual(sum(counts), 30)
        self.assertTrue(all(c >= 2 for c in counts),
                        "power_of_two with idle backends used only some: %r" % counts)


class PrefixAffinityTest(ProdCase):
    def setUp(self):
        super().setUp()
        self.P = [self.mock(prefill_handler(), name="P%d" % i) for i in range(4)]
        self.D = self.mock(decode_handler(), name="D")

    def where(self, rid):
        hits = [i for i, m in enumerate(self.P)
                if any(r.header("x-request-id") == rid for r in list(m.requests))]
        self.assertEqual(len(hits), 1, "request %s reached prefills %r" % (rid, hits))
        return hits[0]

    def test_repeated_prefix_stays_on_one_prefill(self):
        px = self.start(self.P, [self.D], ["--prefill-policy", "prefix_affinity",
                                           "--prefix-bytes", "64"])
        homes = {}
        for k in range(12):
            prefix = ("system prompt %d: you are a helpful assistant. " % k) * 3
            self.assertGreater(len(prefix), 64)
            seen = set()
            for j in range(5):
                rid = "pa-%d-%d" % (k, j)
                r = self.post(px, prompt_body(prefix, " question %d?" % j),
                              headers={"X-Request-Id": rid})
                self.assertEqual(r.status, 200)
                seen.add(self.where(rid))
            self.assertEqual(len(seen), 1, "prefix %d spread over prefills %r" % (k, seen))
            homes[k] = seen.pop()
        self.assertGreaterEqual(len(set(homes.values())), 2,
                                "12 different prefixes all hashed to one prefill: %r" % homes)

    def test_chat_first_messages_stay_on_one_prefill(self):
        px = self.start(self.P, [self.D], ["--prefill-policy", "prefix_affinity",
                                           "--prefix-bytes", "200"])
        system = {"role": "system", "content": "You answer in French. " * 12}
        homes = set()
        for j in range(6):
            rid = "chat-%d" % j
            body = chat_body(messages=[system, {"role": "user", "content": "q%d" % j}])
            self.assertEqual(self.post(px, body, path="/v1/chat/completions",
                                       headers={"X-Request-Id": rid}).status, 200)
            homes.add(self.where(rid))
        self.assertEqual(len(homes), 1, homes)

    def test_affinity_survives_unrelated_traffic(self):
        px = self.start(self.P, [self.D], ["--prefill-policy", "prefix_affinity",
                                           "--prefix-bytes", "32"])
        hot = "the hot shared prefix of many requests......"
        homes = set()
        for j in range(8):
            rid = "hot-%d" % j
            self.post(px, prompt_body(hot, str(j)), headers={"X-Request-Id": rid})
            homes.add(self.where(rid))
            self.post(px, prompt_body("unrelated %d " % j * 5, "x"))
        self.assertEqual(len(homes), 1, homes)

    def tenants_homes(self, policy):
        """12 tenants whose prompts open with the same 300 bytes, then their
        own context, 3 questions each: the prefills each tenant reached."""
        px = self.start(self.P, [self.D], ["--prefill-policy", policy])
        opening = "You are a helpful assistant who answers briefly. " * 6
        self.assertGreater(len(opening), 256)
        homes = {}
        for k in range(12):
            context = ("tenant %d keeps these facts in mind. " % k) * 12
            seen = set()
            for j in range(3):
                rid = "%s-%d-%d" % (policy, k, j)
                r = self.post(px, prompt_body(opening + context, " question %d?" % j),
                              headers={"X-Request-Id": rid})
                self.assertEqual(r.status, 200)
                seen.add(self.where(rid))
            homes[k] = seen
        return homes

    def test_whole_chain_spreads_a_shared_opening(self):
        homes = self.tenants_homes("prefix_affinity")
        for k, seen in homes.items():
            self.assertEqual(len(seen), 1, "tenant %d spread over prefills %r" % (k, seen))
        used = {next(iter(s)) for s in homes.values()}
        self.assertGreaterEqual(len(used), 2, "12 tenants all on one prefill: %r" % homes)

    def test_first_bytes_only_with_prefix_affinity_bytes(self):
        """The former behaviour, kept to compare: the shared opening is all
        it sees, so every tenant lands on one prefill."""
        homes = self.tenants_homes("prefix_affinity_bytes")
        used = set().union(*homes.values())
        self.assertEqual(len(used), 1, homes)

    def test_conversation_follows_its_chain(self):
        """A chat growing turn by turn stays where its history went, with
        other conversations in between."""
        px = self.start(self.P, [self.D], ["--prefill-policy", "prefix_affinity"])
        convs = {c: [{"role": "system", "content": "Conversation %d. " % c * 20}]
                 for c in range(6)}
        homes = {c: set() for c in convs}
        for turn in range(4):
            for c, msgs in convs.items():
                msgs.append({"role": "user", "content": "turn %d of %d: %s" % (turn, c, "x" * 90)})
                rid = "conv-%d-%d" % (c, turn)
                r = self.post(px, chat_body(messages=msgs), path="/v1/chat/completions",
                              headers={"X-Request-Id": rid})
                self.assertEqual(r.status, 200)
                homes[c].add(self.where(rid))
                msgs.append({"role": "assistant", "content": "reply %d %s" % (turn, "y" * 90)})
        for c, seen in homes.items():
            self.assertEqual(len(seen), 1, "conversation %d moved: %r" % (c, seen))
        self.assertGreaterEqual(len(set().union(*homes.values())), 2, homes)

    def concurrent_same_prefix(self, factor, n):
        for m in self.P:
            m.set_handler(prefill_handler(delay=1.5))
        px = self.start(self.P, [self.D], ["--prefill-policy", "prefix_affinity",
                                           "--prefix-bytes", "32",
                                           "--prefix-load-factor", str(factor)])
        prefix = "one very hot prefix shared by all of them "
        # All n hang at the prefills together (1.5 s each).
        res = self.concurrent(lambda i: self.post(px, prompt_body(prefix, str(i)),
                                                  headers={"X-Request-Id": "hot-%d" % i}).status,
                              n, timeout=30)
        self.assertEqual(res, [200] * n)
        return [len(m.requests) for m in self.P]

    def test_bounded_load_spreads_a_hot_prefix(self):
        n, factor = 12, 1.25
        counts = self.concurrent_same_prefix(factor, n)
        self.assertEqual(sum(counts), n)
        # With c = 1.25 over 4 instances, no instance may hold more than
        # ceil(1.25 * n / 4) of the n requests in flight at once.
        cap = -(-int(factor * n * 100) // 400)
        self.assertLessEqual(max(counts), cap, "hot prefix over the bounded-load cap: %r" % counts)
        self.assertGreaterEqual(sum(1 for c in counts if c), 3, counts)

    def test_high_load_factor_keeps_the_prefix_home(self):
        counts = self.concurrent_same_prefix(100, 12)
        self.assertEqual(sorted(counts), [0, 0, 0, 12],
                         "--prefix-load-factor 100 should keep all 12 on the home prefill: %r"
                         % counts)


class LoadAwareTest(ProdCase):
    INTERVAL = 0.2

    def wait_load_probes(self, mocks, n, timeout=5.0):
        def probes(m):
            return sum(1 for r in list(m.probes) if r.path.startswith("/metrics"))

        base = {id(m): probes(m) for m in mocks}
        if wait_until(lambda: all(probes(m) - base[id(m)] >= n for m in mocks), timeout, 0.02):
            return
        self.fail("pdproxy did not probe /metrics of every engine %d times in %.1fs "
                  "(--metrics-interval %g)" % (n, timeout, self.INTERVAL))

    def run_role(self, role):
        st = [{"waiting": 40, "running": 8}, {"waiting": 0, "running": 0}]
        if role == "prefill":
            B = [self.mock(prefill_handler(), name="P%d" % i) for i in range(2)]
            other = self.mock(decode_handler(), name="D")
            args = (B, [other])
        else:
            B = [self.mock(decode_handler(), name="D%d" % i) for i in range(2)]
            other = self.mock(prefill_handler(), name="P")
            args = ([other], B)
        for m, s in zip(B, st):
            m.probe_handler = engine_metrics_handler(s)
        px = self.start(*args, extra=["--%s-policy" % role, "load_aware",
                                      "--metrics-interval", str(self.INTERVAL)])
        self.wait_load_probes(B, 2)
        for i in range(10):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual([len(m.requests) for m in B], [0, 10],
                         "load_aware sent traffic to the engine reporting 40 waiting")
        # The load moves: after the next load probes so does the traffic.
        st[0].update(waiting=0, running=0)
        st[1].update(waiting=40, running=8)
        self.wait_load_probes(B, 2)
        for i in range(10):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual([len(m.requests) for m in B], [10, 10],
                         "load_aware did not follow the engines' new figures")
        return px

    def test_load_aware_prefill(self):
        self.run_role("prefill")

    def test_load_aware_decode(self):
        self.run_role("decode")

    def test_kv_cache_usage_counts(self):
        B = [self.mock(prefill_handler(), name="P%d" % i) for i in range(2)]
        D = self.mock(decode_handler(), name="D")
        st = [{"kv": "0.95"}, {"kv": "0.05"}]
        for m, s in zip(B, st):
            m.probe_handler = engine_metrics_handler(s)
        px = self.start(B, [D], ["--prefill-policy", "load_aware",
                                 "--metrics-interval", str(self.INTERVAL)])
        self.wait_load_probes(B, 2)
        for i in range(6):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual([len(m.requests) for m in B], [0, 6])

    def test_no_scrapes_without_load_aware(self):
        B = [self.mock(prefill_handler(), name="P%d" % i) for i in range(2)]
        D = self.mock(decode_handler(), name="D")
        # Health checks every 0.05 s too: ten of them on every engine are
        # ten intervals of pdproxy's timers, each one a scrape would have
        # shown in.
        self.start(B, [D], ["--metrics-interval", "0.05"], health_interval="0.05")
        for m in B + [D]:
            self.assertGreaterEqual(m.wait_probes(10, 5.0), 10, "%s: health checks" % m.name)
        self.assertEqual([r.path for m in B + [D] for r in m.probes if "metrics" in r.path], [])


if __name__ == "__main__":
    unittest.main(verbosity=2)
