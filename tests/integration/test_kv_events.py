#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""pdproxy's KV-event subscriber and index (proxy/kvevents.c, kvindex.c)
against publishers speaking vLLM's wire format over real ZeroMQ
(pdharness/kvpub.py): stores, removals and clears reach the index; a
sequence gap is replayed, or drops the backend's index when it cannot be;
a restarted engine starts empty; hostile publishers (garbage, huge frames,
floods past the bound) neither crash pdproxy nor grow it past its bound;
two replicas subscribed to the same engines hold the same index.

Each backend has its own loopback address (127.0.0.2, .3) so that both
publishers listen on the one --kv-events-port. The backends' HTTP ports
serve nothing: these cases route no request."""

import socket
import unittest

from pdharness.ctl import admin, tmpdir, token_file
from pdharness.kvpub import Publisher, cleared, removed, stored
from pdharness.net import closed_port, free_port, wait_value
from pdharness.procs import ProxyStartError, rss_bytes, sanitized
from pdharness.prod import ProdCase
from pdharness.prom import metric, prom

BS = 4
HOSTS = ("127.0.0.2", "127.0.0.3")


def tokens(p, nblocks, first=0):
    """Token ids of blocks first..first+nblocks of prompt p."""
    return [p * 100000 + i for i in range(first * BS, (first + nblocks) * BS)]


def port_free_on(hosts, port):
    for h in hosts:
        s = socket.socket()
        try:
            s.bind((h, port))
        except OSError:
            return False
        finally:
            s.close()
    return True


class KvEventsTest(ProdCase):
    def setUp(self):
        super().setUp()
        self.dir = tmpdir(self)
        self.tokpath, self.token = token_file(self, self.dir)

    def publishers(self, replay=False, buffer=10000, hosts=HOSTS):
        for _ in range(20):
            port, rport = free_port(), free_port()
            if port_free_on(hosts, port) and port_free_on(hosts, rport):
                break
        self.kvport, self.rport = port, (rport if replay else 0)
        pubs = []
        for h in hosts:
            p = Publisher(h, port, rport if replay else None, buffer=buffer)
            self.addCleanup(p.close)
            pubs.append(p)
        return pubs

    def start_px(self, extra=(), keep=False):
        if not keep:
            self.backends = ["%s:%d" % (h, closed_port()) for h in HOSTS]
        for _ in range(3):
            self.aport = free_port()
            try:
                px = self.start(args=["--prefill", "http://" + self.backends[0],
                                      "--decode", "http://" + self.backends[1],
                                      "--kv-events-port", str(self.kvport),
                                      "--kv-events-replay-port", str(self.rport),
                                      "--admin-port", str(self.aport),
                                      "--admin-token-file", self.tokpath] + list(extra))
                return px
            except ProxyStartError as e:
                if "admin" not in str(e):
                    raise
        raise AssertionError("no free admin port")

    def index(self, backend=None, toks=None, aport=None, model=None):
        q = []
        if model:
            q.append("model=" + model)
        if backend:
            q.append("backend=" + backend)
        if toks is not None:
            q.append("tokens=" + ",".join(map(str, toks)))
        st, doc = admin(aport or self.aport, "GET", "/admin/kv_index" + ("?" + "&".join(q) if q else ""),
                        token=self.token)
        self.assertEqual(st, 200, doc)
        return doc

    def blocks(self, i, aport=None):
        return self.index(self.backends[i], aport=aport)["backends"][0]["blocks"]

    def wait_blocks(self, i, want, aport=None, timeout=10.0):
        got = wait_value(lambda: self.blocks(i, aport), lambda v: v == want, timeout)
        self.assertEqual(got, want, "backend %s: %s blocks, wanted %d"
                         % (self.backends[i], got, want))

    def match(self, toks, aport=None, model=None):
        return self.index(toks=toks, aport=aport, model=model)["match"]

    def sub(self, i):
        return self.index(self.backends[i])["backends"][0]

    # ------------------------------------------------------------------

    def test_store_remove_clear(self):
        P, D = self.publishers()
        px = self.start_px()
        P.wait_subscriber()
        D.wait_subscriber()
        t = tokens(1, 6)
        # Array layout on P: blocks 0-2, then 3-5 chained to block 2.
        P.publish([stored([11, 12, 13], None, t[:3 * BS], BS)])
        P.publish([stored([14, 15, 16], 13, t[3 * BS:], BS)])
        # Map layout with bytes hashes on D: blocks 0-1.
        D.publish([stored([b"h" * 32, b"i" * 32], None, t[:2 * BS], BS)], layout="map")
        self.wait_blocks(0, 6)
        self.wait_blocks(1, 2)
        self.assertEqual(self.match(t), {self.backends[0]: 6, self.backends[1]: 2})
        # A prompt that shares one block with them.
        other = t[:BS] + tokens(2, 3)
        self.assertEqual(self.match(other), {self.backends[0]: 1, self.backends[1]: 1})
        # Removal (by vLLM's hash) cuts the prefix; a clear empties D.
        P.publish([removed([14])])
        D.publish([cleared()], layout="map")
        self.wait_blocks(0, 5)
        self.wait_blocks(1, 0)
        self.assertEqual(self.match(t), {self.backends[0]: 3, self.backends[1]: 0})
        s = prom(px.port)
        self.assertEqual(metric(s, "pdproxy_kv_index_blocks", backend=self.backends[0]), 5)
        self.assertGreater(metric(s, "pdproxy_kv_index_bytes", backend=self.backends[0]), 0)
        self.assertEqual(metric(s, "pdproxy_kv_events_total"), 5)
        self.assertEqual(metric(s, "pdproxy_kv_event_gaps_total"), 0)
        sub = self.sub(0)
        self.assertEqual(sub["next_seq"], 3)
        self.assertEqual(sub["block_size"], BS)
        self.assertEqual(sub["endpoint"], "tcp://%s:%d" % (HOSTS[0], self.kvport))
        # Bad queries.
        st, doc = admin(self.aport, "GET", "/admin/kv_index?tokens=1,x", token=self.token)
        self.assertEqual(st, 400)
        self.assertIn("tokens", doc["error"]["message"])
        st, doc = admin(self.aport, "GET", "/admin/kv_index?backend=nope:1", token=self.token)
        self.assertEqual(st, 404)
        st, _ = admin(self.aport, "POST", "/admin/kv_index", token=self.token)
        self.assertEqual(st, 405)

    def test_gap_replayed(self):
        P, D = self.publishers(replay=True)
        px = self.start_px()
        P.wait_subscriber()
        P.publish([stored([1], None, tokens(1, 1), BS)])
        self.wait_blocks(0, 1)
        # Batch 1 never crosses the PUB socket: only the replay has it.
        P.publish([stored([2], 1, tokens(1, 1, first=1), BS)], send=False)
        P.publish([stored([3], 2, tokens(1, 1, first=2), BS)])
        self.wait_blocks(0, 3)
        self.assertEqual(self.match(tokens(1, 3))[self.backends[0]], 3)
        self.assertEqual(P.replay_requests, [1])
        s = prom(px.port)
        self.assertEqual(metric(s, "pdproxy_kv_event_gaps_total"), 1)
        self.assertEqual(metric(s, "pdproxy_kv_event_replays_total"), 1)
        self.assertEqual(metric(s, "pdproxy_kv_index_resets_total"), 0)
        self.assertEqual(self.sub(0)["next_seq"], 3)

    def test_gap_without_replay_drops_the_index(self):
        P, D = self.publishers(replay=False)
        px = self.start_px()
        P.wait_subscriber()
        P.publish([stored([1, 2], None, tokens(1, 2), BS)])
        self.wait_blocks(0, 2)
        P.publish([stored([3], None, tokens(2, 1), BS)], send=False)
        P.publish([stored([4], None, tokens(3, 1), BS)])
        # What the gap may have removed is unknown: only what follows it stays.
        self.wait_blocks(0, 1)
        m = self.match(tokens(3, 1))
        self.assertEqual(m[self.backends[0]], 1)
        self.assertEqual(self.match(tokens(1, 2))[self.backends[0]], 0)
        s = prom(px.port)
        self.assertEqual(metric(s, "pdproxy_kv_event_gaps_total"), 1)
        self.assertEqual(metric(s, "pdproxy_kv_index_resets_total"), 1)
        self.assertEqual(metric(s, "pdproxy_kv_event_replays_total"), 0)

    def test_replay_that_cannot_fill_the_gap(self):
        P, D = self.publishers(replay=True, buffer=1)
        px = self.start_px()
        P.wait_subscriber()
        P.publish([stored([1], None, tokens(1, 1), BS)])
        self.wait_blocks(0, 1)
        P.publish([stored([2], None, tokens(2, 1), BS)], send=False)
        P.publish([stored([3], None, tokens(3, 1), BS)], send=False)
        P.publish([stored([4], None, tokens(4, 1), BS)])
        # The engine kept one batch: the replay starts past the gap.
        got = wait_value(lambda: metric(prom(px.port), "pdproxy_kv_event_replay_failures_total"),
                         lambda v: v == 1, 10.0)
        self.assertEqual(got, 1)
        self.wait_blocks(0, 1)
        self.assertEqual(self.match(tokens(4, 1))[self.backends[0]], 1)
        self.assertEqual(self.match(tokens(1, 1))[self.backends[0]], 0)

    def test_restarted_engine_starts_empty(self):
        P, D = self.publishers()
        px = self.start_px()
        P.wait_subscriber()
        for i in range(5):
            P.publish([stored([10 + i], None, tokens(i, 1), BS)])
        self.wait_blocks(0, 5)
        P.close()
        # The engine comes back on the same port; its sequence starts at 0.
        P2 = Publisher(HOSTS[0], self.kvport)
        self.addCleanup(P2.close)
        P2.wait_subscriber()
        P2.publish([stored([99], None, tokens(9, 1), BS)])
        self.wait_blocks(0, 1)
        self.assertEqual(self.match(tokens(9, 1))[self.backends[0]], 1)
        self.assertIn(metric(prom(px.port), "pdproxy_kv_index_resets_total"), (1, 2))
        # Dropped when the connection ended (ZeroMQ's monitor) or, had the
        # reconnection been too quick to notice, when the sequence restarted.
        self.assertRegex(px.stderr(), "reason=(publisher_disconnected|sequence_restarted)")

    def test_hostile_publisher(self):
        P, D = self.publishers()
        px = self.start_px(extra=["--kv-index-max-blocks", "100"])
        P.wait_subscriber()
        rss0 = rss_bytes(px.proc.pid)
        seq = (0).to_bytes(8, "big")
        # Garbage msgpack, a declared 4-billion-element array, wrong frames.
        P.send_raw([b"t", seq, b"\xc1\xff\x00garbage"])
        P.send_raw([b"t", (1).to_bytes(8, "big"), b"\x93\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff"])
        P.send_raw([b"t", b"short", b"x"])
        P.send_raw([b"only one frame"])
        got = wait_value(lambda: metric(prom(px.port), "pdproxy_kv_events_malformed_total"),
                         lambda v: v == 4, 10.0)
        self.assertEqual(got, 4)
        # A frame past the message bound: libzmq drops that connection; the
        # subscriber reconnects.
        old = list(P.pub.peers)
        P.send_raw([b"t", (2).to_bytes(8, "big"), b"\x00" * (5 << 20)])
        got = wait_value(lambda: list(P.pub.peers), lambda v: v and v[0] not in old, 10.0)
        self.assertTrue(got and got[0] not in old, "pdproxy did not reconnect")
        # A flood of stores past --kv-index-max-blocks. The peer seen above
        # may be libzmq's own reconnection of the socket that pdproxy is
        # about to replace (it makes the socket again once its monitor
        # reports the disconnect), and what is sent to that one is lost
        # with it: the flood is sent again, at most 5 times, until pdproxy
        # has counted refusals.
        P.seq = 3
        got = None
        for _ in range(5):
            for i in range(400):
                hs = list(range(1000 + i * 10, 1000 + i * 10 + 10))
                P.publish([stored(hs, None, tokens(i, 10), BS)])
            got = wait_value(
                lambda: metric(prom(px.port), "pdproxy_kv_index_refused_blocks_total"),
                lambda v: v is not None and v > 0, 2.0)
            if got:
                break
        self.assertGreater(got, 0)
        self.assertLessEqual(self.blocks(0), 100)
        self.assertEqual(self.blocks(0), 100)
        # Bounded: the index and ZeroMQ's queues stay small.
        self.assertLess(rss_bytes(px.proc.pid) - rss0, 64 << 20)
        self.assertIsNone(px.proc.poll())
        # Still follows the engine.
        P.publish([cleared()])
        self.wait_blocks(0, 0)

    def test_flood_past_the_total_bytes_bound(self):
        """--kv-index-max-bytes bounds the tables of all backends together:
        a flood on both publishers, far past it (unbounded, its tables would
        take over 30 MiB), is refused and counted, the index's bytes stay
        within the bound and the process's RSS grows by about as much."""
        bound = 4 << 20
        P, D = self.publishers(buffer=1)
        px = self.start_px(extra=["--kv-index-max-blocks", "10000000",
                                  "--kv-index-max-bytes", str(bound)])
        P.wait_subscriber()
        D.wait_subscriber()
        rss0 = rss_bytes(px.proc.pid)
        per, batches = 1000, 200
        for i in range(batches):
            for k, pub in enumerate((P, D)):
                first = (k * batches + i) * per
                hs = list(range(first + 1, first + per + 1))
                pub.publish([stored(hs, None, hs, 1)])
        got = wait_value(lambda: metric(prom(px.port), "pdproxy_kv_events_total"),
                         lambda v: v == 2 * batches, 60.0)
        self.assertEqual(got, 2 * batches)
        s = prom(px.port)
        self.assertEqual(metric(s, "pdproxy_kv_index_resets_total"), 0)
        total = metric(s, "pdproxy_kv_index_total_bytes")
        self.assertLessEqual(total, bound)
        self.assertGreater(total, bound // 4)
        blocks = [metric(s, "pdproxy_kv_index_blocks", backend=b) for b in self.backends]
        self.assertEqual(metric(s, "pdproxy_kv_index_total_blocks"), sum(blocks))
        self.assertEqual(metric(s, "pdproxy_kv_index_refused_blocks_total"),
                         2 * batches * per - sum(blocks))
        self.assertEqual(sum(metric(s, "pdproxy_kv_index_bytes", backend=b)
                             for b in self.backends), total)
        grown = rss_bytes(px.proc.pid) - rss0
        # Under AddressSanitizer freed memory sits in its quarantine (up to
        # 256 MiB) and counts in RSS: only the index's own figure holds there.
        if not sanitized(px.proc.pid):
            self.assertLess(grown, bound + (12 << 20), "RSS grew by %d bytes" % grown)
        self.assertIsNone(px.proc.poll())
        # What a cleared engine held is free for the other one again.
        P.publish([cleared()])
        self.wait_blocks(0, 0)
        left = metric(prom(px.port), "pdproxy_kv_index_total_bytes")
        self.assertLess(left, total)
        first = 2 * batches * per + 1
        hs = list(range(first, first + 100))
        D.publish([stored(hs, None, hs, 1)])
        self.wait_blocks(1, blocks[1] + 100)

    def test_lora_blocks_match_only_their_adapter(self):
        """vLLM stores a LoRA request's blocks with lora_name and the request
        names the adapter as its model: a prompt for the adapter matches only
        the adapter's blocks, a base-model prompt only the base model's."""
        P, D = self.publishers()
        self.start_px()
        P.wait_subscriber()
        t, u = tokens(1, 3), tokens(2, 3)
        P.publish([stored([1, 2, 3], None, t, BS, lora_name="sql-lora")])
        P.publish([stored([4, 5, 6], None, u, BS)], layout="map")
        self.wait_blocks(0, 6)
        b = self.backends[0]
        self.assertEqual(self.match(t, model="sql-lora")[b], 3)
        self.assertEqual(self.match(t, model="base-model")[b], 0)
        self.assertEqual(self.match(t)[b], 0)
        self.assertEqual(self.match(u, model="sql-lora")[b], 0)
        self.assertEqual(self.match(u, model="base-model")[b], 3)
        # Same tokens as the adapter's, stored for the base model: each
        # request finds its own.
        P.publish([stored([7, 8], None, t[:2 * BS], BS)])
        self.wait_blocks(0, 8)
        self.assertEqual(self.match(t, model="base-model")[b], 2)
        self.assertEqual(self.match(t, model="sql-lora")[b], 3)

    def test_two_replicas_hold_the_same_index(self):
        P, D = self.publishers()
        self.start_px()
        a1 = self.aport
        self.start_px(keep=True)
        a2 = self.aport
        for pub in (P, D):
            n = wait_value(lambda: len(pub.pub.peers), lambda v: v == 2, 10.0)
            self.assertEqual(n, 2)
        for i in range(20):
            P.publish([stored([100 + i], 99 + i if i else None, tokens(7, 1, first=i), BS)])
        for i in range(10):
            D.publish([stored([200 + i], 199 + i if i else None, tokens(7, 1, first=i), BS)])
        for a in (a1, a2):
            self.wait_blocks(0, 20, aport=a)
            self.wait_blocks(1, 10, aport=a)
        for n, first_other in ((25, 25), (25, 4), (8, 8), (25, 0)):
            t = tokens(7, first_other) + tokens(8, n - first_other)
            m1, m2 = self.match(t, aport=a1), self.match(t, aport=a2)
            self.assertEqual(m1, m2)
            self.assertEqual(m1, {self.backends[0]: min(first_other, 20),
                                  self.backends[1]: min(first_other, 10)})


if __name__ == "__main__":
    unittest.main()
