#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kv_aware routing (proxy/route.c) on the index the engines' KV events
feed (pdharness/kvpub.py publishers beside mock engines): the prefill
holding the prompt's prefix gets it; load counted in prompt tokens moves
requests off a busy engine; two pdproxy replicas choose the same backends
for the same requests; --disagg-min-tokens decides on the exact uncached
remainder the decode's index reports.

Prompts are token ids (/v1/completions accepts them), so the tokens are
exact without a tokenizer."""

import json
import threading
import time
import unittest

from pdharness.kvpub import Publisher, stored
from pdharness.mocks import HostMock, Respond, decode_handler, prefill_handler
from pdharness.net import free_port, wait_until, wait_value
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom

from test_kv_events import BS, port_free_on, tokens

HOSTS = ("127.0.0.2", "127.0.0.3")


class KvRoutingTest(ProdCase):
    def engines(self, hosts=HOSTS, handler=None):
        for _ in range(20):
            self.kvport = free_port()
            if port_free_on(hosts, self.kvport):
                break
        mocks, pubs = [], []
        for i, h in enumerate(hosts):
            m = HostMock(handler or prefill_handler(), name="P%d" % i, host=h)
            self._mocks.append(m)
            self.addCleanup(self._stop_mock, m)
            p = Publisher(h, self.kvport)
            self.addCleanup(p.close)
            mocks.append(m)
            pubs.append(p)
        return mocks, pubs

    def start_kv(self, prefill, decode, extra=()):
        return self.start(prefill=[(m.bind_host, m.port) for m in prefill],
                          decode=[(m.bind_host, m.port) if isinstance(m, HostMock) else m
                                  for m in decode],
                          extra=["--kv-events-port", str(self.kvport)] + list(extra))

    def index_has(self, px, m, n):
        got = wait_value(lambda: metric(prom(px.port), "pdproxy_kv_index_blocks",
                                        backend=self.bname(m)), lambda v: v == n, 10.0)
        self.assertEqual(got, n, "index of %s" % self.bname(m))

    def send(self, px, toks, n=1):
        for _ in range(n):
            r = self.post(px, {"model": "m", "prompt": toks, "max_tokens": 4})
            self.assertEqual(r.status, 200, r.body)

    def counts(self, mocks):
        return [len(m.requests) for m in mocks]

    def test_prefill_holding_the_prefix_gets_it(self):
        (P0, P1), (E0, E1) = self.engines()
        D = self.mock(decode_handler(), name="D")
        px = self.start_kv([P0, P1], [D], extra=["--prefill-policy", "kv_aware"])
        E0.wait_subscriber()
        E1.wait_subscriber()
        a, b = tokens(1, 8), tokens(2, 8)
        E0.publish([stored(range(100, 108), None, a, BS)])
        E1.publish([stored(range(200, 208), None, b, BS)])
        self.index_has(px, P0, 8)
        self.index_has(px, P1, 8)
        # A prompt that extends what each engine holds goes to that engine,
        # every time (requests end before the next: no load to weigh).
        self.send(px, a + [5, 6, 7], n=3)
        self.assertEqual(self.counts([P0, P1]), [3, 0])
        self.send(px, b[:6 * BS] + [9] * 10, n=3)
        self.assertEqual(self.counts([P0, P1]), [3, 3])

    def test_load_in_tokens_moves_requests(self):
        (P0, P1), (E0, E1) = self.engines(handler=prefill_handler(delay=1.5))
        D = self.mock(decode_handler(), name="D")
        # Each cached token is worth 0.1 token of load.
        px = self.start_kv([P0, P1], [D], extra=["--prefill-policy", "kv_aware",
                                                 "--kv-cache-weight", "0.1"])
        E0.wait_subscriber()
        a = tokens(3, 4)
        E0.publish([stored(range(300, 304), None, a, BS)])
        self.index_has(px, P0, 4)
        # A long prompt sharing the cached prefix goes to P0 and stays 1.5 s;
        # its 416 tokens in flight outweigh the next prompt's 16 cached ones.
        big = a + tokens(4, 100)
        t = threading.Thread(target=self.send, args=(px, big), daemon=True)
        t.start()
        self.assertEqual(len(P0.wait_requests(1, 5.0)), 1)
        self.send(px, a + [1])
        t.join(10)
        self.assertFalse(t.is_alive())
        self.assertEqual(self.counts([P0, P1]), [1, 1])
        self.assertIn(b"[300000,", P0.requests[0].body.replace(b" ", b""))
        # Once it is done, the cache wins again.
        self.send(px, a + [1])
        self.assertEqual(self.counts([P0, P1]), [2, 1])

    def test_load_counts_only_uncached_tokens(self):
        """An engine is charged with what it computes of a prompt, not the
        whole prompt: a request running there with 40 of its 43 tokens
        cached leaves that engine the better place for the next one
        (charged 43, it would not be: 40 cached - 43 < 0)."""
        (P0, P1), (E0, E1) = self.engines(handler=prefill_handler(delay=1.5))
        D = self.mock(decode_handler(), name="D")
        px = self.start_kv([P0, P1], [D], extra=["--prefill-policy", "kv_aware"])
        E0.wait_subscriber()
        a = tokens(11, 10)
        E0.publish([stored(range(1100, 1110), None, a, BS)])
        self.index_has(px, P0, 10)
        t = threading.Thread(target=self.send, args=(px, a + [1, 2, 3]), daemon=True)
        t.start()
        self.assertEqual(len(P0.wait_requests(1, 5.0)), 1)
        self.send(px, a + [4, 5, 6])
        t.join(10)
        self.assertFalse(t.is_alive())
        self.assertEqual(self.counts([P0, P1]), [2, 0])

    def test_disagg_counts_the_recomputed_last_block(self):
        """The engine recomputes a prompt's last token (vLLM's
        get_computed_blocks: max_cache_hit_length = num_tokens - 1), so a
        prompt all of whose 6 blocks the decode holds still lacks its last
        block: 4 tokens, not 0, against --disagg-min-tokens 4."""
        (D0, D1), (E0, E1) = self.engines(handler=decode_handler())
        P = self.mock(prefill_handler(), name="P")
        px = self.start_kv([P], [D0, D1], extra=["--decode-policy", "kv_aware",
                                                 "--disagg-min-tokens", "4"])
        E0.wait_subscriber()
        a = tokens(12, 6)
        E0.publish([stored(range(1200, 1206), None, a, BS)])
        self.index_has(px, D0, 6)
        self.send(px, a)  # 20 reusable, 4 to compute: prefill first
        self.assertEqual(len(P.requests), 1)
        self.send(px, a + [1])  # 24 reusable, 1 to compute: decode alone, on D0
        self.assertEqual(len(P.requests), 1)
        self.assertEqual(self.counts([D0, D1])[0], 2)
        s = prom(px.port)
        self.assertEqual(metric(s, "pdproxy_disagg_decisions_total", reason="long_prompt"), 1)
        self.assertEqual(metric(s, "pdproxy_disagg_decisions_total", reason="cached_prefix"), 1)

    def test_two_replicas_choose_the_same(self):
        (P0, P1), (E0, E1) = self.engines()
        D = self.mock(decode_handler(), name="D")
        px1 = self.start_kv([P0, P1], [D], extra=["--prefill-policy", "kv_aware"])
        px2 = self.start_kv([P0, P1], [D], extra=["--prefill-policy", "kv_aware"])
        for e in (E0, E1):
            n = wait_value(lambda: len(e.pub.peers), lambda v: v == 2, 10.0)
            self.assertEqual(n, 2)
        E0.publish([stored(range(500, 504), None, tokens(5, 4), BS)])
        E1.publish([stored(range(600, 604), None, tokens(6, 4), BS)])
        for px in (px1, px2):
            self.index_has(px, P0, 4)
            self.index_has(px, P1, 4)
        # Cached prompts and uncached ones (the tie-break decides).
        prompts = [tokens(5, 4) + [1], tokens(6, 4) + [2]] + [tokens(10 + i, 3) for i in range(12)]
        chosen = []
        for px in (px1, px2):
            seen = []
            for t in prompts:
                before = self.counts([P0, P1])
                self.send(px, t)
                after = self.counts([P0, P1])
                seen.append(0 if after[0] > before[0] else 1)
            chosen.append(seen)
        self.assertEqual(chosen[0], chosen[1])
        self.assertEqual(chosen[0][:2], [0, 1])
        # The tie-break spreads uncached prompts over both.
        self.assertEqual(set(chosen[0][2:]), {0, 1})

    def test_disagg_on_the_exact_uncached_remainder(self):
        (D0, D1), (E0, E1) = self.engines(handler=decode_handler())
        P = self.mock(prefill_handler(), name="P")
        px = self.start_kv([P], [D0, D1], extra=["--decode-policy", "kv_aware",
                                                 "--disagg-min-tokens", "8"])
        E0.wait_subscriber()
        a = tokens(7, 6)
        E0.publish([stored(range(700, 706), None, a, BS)])
        self.index_has(px, D0, 6)
        # 24 cached tokens + 4 more: 4 uncached, under 8: decode alone, on D0.
        self.send(px, a + [1, 2, 3, 4])
        self.assertEqual(self.counts([D0, D1]), [1, 0])
        self.assertEqual(len(P.requests), 0)
        # 20 tokens nobody holds: prefill first.
        self.send(px, tokens(8, 5))
        self.assertEqual(len(P.requests), 1)
        s = prom(px.port)
        self.assertEqual(metric(s, "pdproxy_disagg_decisions_total", reason="cached_prefix"), 1)
        self.assertEqual(metric(s, "pdproxy_disagg_decisions_total", reason="long_prompt"), 1)


    def test_disaggregated_request_is_no_load_on_its_decode(self):
        """A request decided for prefill is charged nothing on the decode
        chosen beforehand (it receives the KV), so a decode-local request
        sent meanwhile still goes to the decode holding its prefix."""
        slow_d = decode_handler()
        # The long request is held on D0 until the test has routed the other:
        # its load is there for the whole decision, however slow the machine.
        release = threading.Event()

        def h(req):
            if b"long" in req.body:
                release.wait(10.0)
            return slow_d(req)

        (D0, D1), (E0, E1) = self.engines(handler=h)
        self.addCleanup(release.set)  # runs before the mocks stop
        P = self.mock(prefill_handler(), name="P")
        px = self.start_kv([P], [D0, D1], extra=["--decode-policy", "kv_aware",
                                                 "--disagg-min-tokens", "4"])
        E0.wait_subscriber()
        a, lng = tokens(13, 6), tokens(14, 1)
        E0.publish([stored(range(1300, 1306), None, a, BS),
                    stored([1400], None, lng, BS)])
        self.index_has(px, D0, 7)
        # 4 of its 40 tokens cached on D0: D0, through the prefill, held there.
        body = {"model": "m", "prompt": lng + tokens(15, 9), "max_tokens": 4, "user": "long"}
        t = threading.Thread(target=self.post, args=(px, body), daemon=True)
        t.start()
        self.assertTrue(wait_until(lambda: len(D0.requests) == 1, 5.0))
        self.assertEqual(len(P.requests), 1)
        # 24 of 25 cached on D0, which computes nothing for the other: D0 alone.
        self.send(px, a + [1])
        self.assertTrue(t.is_alive(), "the long request ended before the other was routed")
        release.set()
        t.join(10)
        self.assertFalse(t.is_alive())
        self.assertEqual(self.counts([D0, D1]), [2, 0])
        self.assertEqual(len(P.requests), 1)

    def tokenizing_engine(self, delay=0.0, status=200):
        """A prefill engine whose /tokenize gives one token per character
        (ord), as vLLM's answer is shaped: {"count","max_model_len","tokens"}."""
        inner = prefill_handler()

        def h(req):
            if req.path == "/tokenize":
                doc = json.loads(req.body)
                text = doc.get("prompt")
                if text is None:
                    text = "".join(m["content"] for m in doc["messages"])
                toks = [ord(c) for c in text]
                body = json.dumps({"count": len(toks), "max_model_len": 4096,
                                   "tokens": toks}).encode()
                return Respond(status, [("Content-Type", "application/json")], body, delay=delay)
            return inner(req)
        return h

    def test_text_prompts_tokenized_by_the_engine(self):
        (P0, P1), (E0, E1) = self.engines(handler=self.tokenizing_engine())
        D = self.mock(decode_handler(), name="D")
        px = self.start_kv([P0, P1], [D], extra=["--prefill-policy", "kv_aware",
                                                 "--tokenize-timeout", "5"])
        E1.wait_subscriber()
        text = "the quick brown fox jumps over"  # 30 characters: 7 blocks of 4
        E1.publish([stored(range(900, 907), None, [ord(c) for c in text[:28]], BS)])
        self.index_has(px, P1, 7)
        for i in range(3):
            r = self.post(px, {"model": "m", "prompt": text + " the dog", "max_tokens": 4})
            self.assertEqual(r.status, 200, r.body)
        gen = [q for q in P1.requests if q.path != "/tokenize"]
        self.assertEqual(len(gen), 3)
        self.assertEqual([q for q in P0.requests if q.path != "/tokenize"], [])
        toks = [q for q in P0.requests + P1.requests if q.path == "/tokenize"]
        # Asked once; the worker's cache answered the others (2 workers:
        # at most one ask each).
        self.assertIn(len(toks), (1, 2))
        body = json.loads(toks[0].body)
        self.assertEqual(body, {"model": "m", "prompt": text + " the dog"})
        s = prom(px.port)
        self.assertEqual(metric(s, "pdproxy_tokenize_total", result="ok"), len(toks))
        self.assertEqual(metric(s, "pdproxy_tokenize_total", result="cached"), 3 - len(toks))
        # Chat messages go as they are.
        r = self.post(px, {"model": "m", "messages": [{"role": "user", "content": text}],
                           "max_tokens": 4}, path="/v1/chat/completions")
        self.assertEqual(r.status, 200, r.body)
        chat = [q for q in P0.requests + P1.requests
                if q.path == "/tokenize" and b"messages" in q.body]
        self.assertEqual(len(chat), 1)

    def test_tokenize_timeout_falls_back_counted(self):
        (P0, P1), _ = self.engines(handler=self.tokenizing_engine(delay=2.0))
        D = self.mock(decode_handler(), name="D")
        px = self.start_kv([P0, P1], [D], extra=["--prefill-policy", "kv_aware",
                                                 "--tokenize-timeout", "0.2"])
        t0 = time.monotonic()
        r = self.post(px, {"model": "m", "prompt": "slow tokenizer", "max_tokens": 4})
        self.assertEqual(r.status, 200, r.body)
        self.assertLess(time.monotonic() - t0, 1.9)  # did not wait for the 2 s answer
        s = prom(px.port)
        self.assertEqual(metric(s, "pdproxy_tokenize_total", result="timeout"), 1)
        self.assertEqual(metric(s, "pdproxy_tokenize_total", result="ok"), 0)
        gen = [q for q in P0.requests + P1.requests if q.path != "/tokenize"]
        self.assertEqual(len(gen), 1)

    def test_unknown_tokens_still_count_as_load(self):
        """A text prompt whose /tokenize does not answer in time is routed
        without a cache to match, but the engine computes all of it: it is
        charged with the byte estimate (400 bytes / 4 = 100 tokens), so
        prompts sent while it runs go to the other engine."""
        slow = prefill_handler(delay=3.0)
        fast = prefill_handler()

        def h(req):
            if req.path == "/tokenize":
                return Respond(200, [("Content-Type", "application/json")],
                               b'{"count":1,"max_model_len":9,"tokens":[1]}', delay=2.0)
            return (slow if b'"prompt": "' in req.body or b'"prompt":"' in req.body
                    else fast)(req)

        (P0, P1), _ = self.engines(handler=h)
        D = self.mock(decode_handler(), name="D")
        px = self.start_kv([P0, P1], [D], extra=["--prefill-policy", "kv_aware",
                                                 "--tokenize-timeout", "0.2"])
        text = "w" * 400
        t = threading.Thread(target=self.post, args=(px, {"model": "m", "prompt": text,
                                                          "max_tokens": 4}), daemon=True)
        t.start()

        def gen(m):
            return [q for q in list(m.requests) if q.path != "/tokenize"]

        self.assertTrue(wait_until(lambda: len(gen(P0)) + len(gen(P1)) == 1, 5.0))
        busy = 0 if gen(P0) else 1
        for i in range(6):
            self.send(px, tokens(20 + i, 2))
        t.join(10)
        self.assertFalse(t.is_alive())
        mocks = [P0, P1]
        self.assertEqual(len(gen(mocks[busy])), 1)
        self.assertEqual(len(gen(mocks[1 - busy])), 6)
        self.assertEqual(metric(prom(px.port), "pdproxy_tokenize_total", result="timeout"), 1)

    def test_tokenize_error_falls_back_counted(self):
        (P0, P1), _ = self.engines(handler=self.tokenizing_engine(status=404))
        D = self.mock(decode_handler(), name="D")
        px = self.start_kv([P0, P1], [D], extra=["--prefill-policy", "kv_aware"])
        r = self.post(px, {"model": "m", "prompt": "no tokenizer here", "max_tokens": 4})
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(metric(prom(px.port), "pdproxy_tokenize_total", result="error"), 1)


    def test_sessions_pin_to_their_decode(self):
        P = self.mock(prefill_handler(), name="P")
        D0 = self.mock(decode_handler(), name="D0")
        D1 = self.mock(decode_handler(), name="D1")
        px = self.start(prefill=[P], decode=[D0, D1])

        def where(body, headers=None):
            before = self.counts([D0, D1])
            r = self.post(px, body, headers=headers)
            self.assertEqual(r.status, 200, r.body)
            after = self.counts([D0, D1])
            return 0 if after[0] > before[0] else 1

        body = {"model": "m", "prompt": "hello", "max_tokens": 4}
        # Without a session, round_robin alternates.
        self.assertEqual({where(body) for _ in range(4)}, {0, 1})
        for sid in ("conv-a", "conv-b", "conv-c"):
            first = where(body, {"x-session-id": sid})
            for _ in range(4):
                self.assertEqual(where(body, {"x-session-id": sid}), first, sid)
        # The body's "user" names a session too.
        ub = dict(body, user="alice")
        first = where(ub)
        self.assertEqual([where(ub) for _ in range(4)], [first] * 4)


if __name__ == "__main__":
    unittest.main()
