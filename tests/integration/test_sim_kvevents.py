#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""engine-sim as vLLM with --kv-events-config: KV cache events on a ZeroMQ
PUB socket ([topic, 8-byte big-endian seq, msgpack KVEventBatch]), replay
of buffered batches through a ROUTER socket (request [b"", start seq],
answers [b"", seq, payload] ... then [b"", -1, b""]), POST /tokenize in
vLLM's shape and the prefix cache that charges prefill per uncached token.

Uses Debian's python3-zmq and python3-msgpack (deploy/local/install-deps.sh);
re-runs itself under /usr/bin/python3 when the python3 on PATH lacks them."""

import os
import sys

try:
    import msgpack
    import zmq
except ImportError:
    if sys.executable != "/usr/bin/python3" and os.path.exists("/usr/bin/python3"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    raise

import json
import time
import unittest

from pdharness.client import http_request
from pdharness.net import HOST, free_port
from pdharness.procs import ENGINE_SIM, SANITIZER_RE, Proc, start_engine_sim
from pdharness.prom import prom_values

BS = 4  # tokens per block in these tests
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def words(n, salt):
    return " ".join("w%s%d" % (salt, i) for i in range(n))


class SimKvEvents(unittest.TestCase):
    def setUp(self):
        self.procs = []
        self.ctx = zmq.Context()

    def tearDown(self):
        self.ctx.destroy(linger=0)
        for p in self.procs:
            was_up = p.alive()
            rc = p.stop()
            san = SANITIZER_RE.search(p.log())
            self.assertIsNone(san, san and san.group(0))
            if was_up:
                self.assertEqual(rc, 0, "%s exited with %s" % (p.name, rc))

    def engine(self, *extra, replay=False, topic=None):
        self.pub = "tcp://%s:%d" % (HOST, free_port())
        self.rep = "tcp://%s:%d" % (HOST, free_port())
        args = ["--block-tokens", str(BS), "--kv-events-endpoint", self.pub]
        if replay:
            args += ["--kv-events-replay-endpoint", self.rep]
        if topic is not None:
            args += ["--kv-events-topic", topic]
        p = start_engine_sim("both", args + list(extra))
        self.procs.append(p)
        self.port = p.port
        return p

    def post(self, path, doc, port=None):
        r = http_request(port or self.port, "POST", path, json.dumps(doc).encode(),
                         [("Content-Type", "application/json")])
        return r.status, (json.loads(r.body) if r.body else None)

    def complete(self, prompt, chat=False):
        if chat:
            st, doc = self.post("/v1/chat/completions", {"model": "sim-model", "max_tokens": 2,
                                                         "messages": prompt})
        else:
            st, doc = self.post("/v1/completions", {"model": "sim-model", "max_tokens": 2,
                                                    "prompt": prompt})
        self.assertEqual(st, 200, doc)
        return doc["usage"]

    def tokenize(self, doc, port=None):
        st, out = self.post("/tokenize", doc, port)
        self.assertEqual(st, 200, out)
        return out

    # -- the subscriber side ------------------------------------------------

    def subscribe(self, topic=b""):
        """A SUB socket that receives everything published from now on:
        resets (each one an AllBlocksCleared batch) until one arrives."""
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(self.pub)
        self.seen = []
        for _ in range(100):
            self.assertEqual(self.post("/reset_prefix_cache", {})[0], 200)
            if self.sub.poll(100):
                self.recv()
                self.catch_up()
                return
        self.fail("no KV event batch reached the subscriber")

    def published(self):
        return int(prom_values(self.port)["engine_sim_kv_events_batches_total"])

    def catch_up(self):
        """Receives until the last batch published so far has arrived."""
        last = self.published() - 1
        for _ in range(1000):
            if self.seen and self.seen[-1] >= last:
                return
            self.recv()
        self.fail("batches up to %d never arrived" % last)

    def recv(self, timeout_ms=5000):
        """The next batch: (topic, seq, decoded payload, raw payload)."""
        self.assertTrue(self.sub.poll(timeout_ms), "no KV event batch in time")
        frames = self.sub.recv_multipart()
        self.assertEqual(len(frames), 3, frames)
        topic, seqb, payload = frames
        self.assertEqual(len(seqb), 8)
        seq = int.from_bytes(seqb, "big")
        self.seen.append(seq)
        return topic, seq, msgpack.unpackb(payload, raw=False, strict_map_key=False), payload

    def events(self):
        _, _, batch, _ = self.recv()
        self.assertIsInstance(batch, list)
        self.assertEqual(len(batch), 3, batch)  # [ts, events, data_parallel_rank]
        self.assertIsInstance(batch[0], float)
        self.assertAlmostEqual(batch[0], time.time(), delta=60)
        self.assertEqual(batch[2], 0)
        return batch[1]

    def assert_stored(self, ev, tokens, parent=None):
        self.assertEqual(ev[0], "BlockStored", ev)
        self.assertEqual(len(ev), 8, ev)
        hashes, par, toks, bs, lora_id, medium, lora_name = ev[1:]
        self.assertEqual(len(hashes), len(tokens) // BS)
        self.assertEqual(len(set(hashes)), len(hashes))
        self.assertEqual(par, parent)
        self.assertEqual(toks, tokens)
        self.assertEqual(bs, BS)
        self.assertEqual((lora_id, medium, lora_name), (None, "GPU", None))
        return hashes

    # -- tests --------------------------------------------------------------

    def test_stored_after_request(self):
        self.engine(topic="kv@sim")
        self.subscribe(b"kv@sim")
        prompt = words(10, "a")  # 10 tokens: two whole blocks
        tok = self.tokenize({"prompt": prompt})["tokens"]
        self.assertEqual(len(tok), 10)
        self.complete(prompt)
        evs = self.events()
        self.assertEqual(len(evs), 1, evs)
        h = self.assert_stored(evs[0], tok[:8])
        # The same prefix plus a block: only the new block, its parent the last one.
        self.complete(prompt + " x y z")  # 13 tokens: three whole blocks
        tok2 = self.tokenize({"prompt": prompt + " x y z"})["tokens"]
        evs = self.events()
        h2 = self.assert_stored(evs[0], tok2[8:12], parent=h[-1])
        self.assertNotIn(h2[0], h)
        # A chat request's blocks are those of its rendered template.
        msgs = [{"role": "system", "content": words(12, "s")},
                {"role": "user", "content": "hi"}]
        ctok = self.tokenize({"messages": msgs})["tokens"]
        self.complete(msgs, chat=True)
        evs = self.events()
        self.assert_stored(evs[0], ctok[:len(ctok) // BS * BS])
        self.assertEqual(self.seen, list(range(self.seen[0], self.seen[0] + len(self.seen))))

    def test_removed_after_eviction_and_cleared_after_reset(self):
        self.engine("--prefix-cache-blocks", "3")
        self.subscribe()
        a, b = words(12, "a"), words(8, "b")
        self.complete(a)
        ha = self.assert_stored(self.events()[0], self.tokenize({"prompt": a})["tokens"])
        self.complete(b)  # two blocks in a cache of three: a's two oldest go
        evs = self.events()
        self.assertEqual([e[0] for e in evs], ["BlockRemoved", "BlockRemoved", "BlockStored"])
        self.assertEqual([e[1] for e in evs[:2]], [[ha[0]], [ha[1]]])
        self.assertEqual([e[2] for e in evs[:2]], ["GPU", "GPU"])
        self.assert_stored(evs[2], self.tokenize({"prompt": b})["tokens"])
        # b is cached: one of its two blocks (never the last token's block).
        self.assertEqual(self.complete(b)["prompt_tokens_details"]["cached_tokens"], 4)
        self.assertEqual(self.post("/reset_prefix_cache", {}), (200, None))
        self.assertEqual(self.events(), [["AllBlocksCleared"]])
        self.assertEqual(self.complete(b)["prompt_tokens_details"]["cached_tokens"], 0)
        m = prom_values(self.port)
        self.assertEqual(m["engine_sim_prefix_cache_blocks"], 2)

    def test_replay_of_a_dropped_sequence(self):
        self.engine("--kv-events-drop-seq", "4", replay=True)
        self.subscribe()
        for i in range(8):
            self.complete(words(8, "r%d" % i))
        pub = {}
        last = self.published() - 1
        for _ in range(100):
            if self.seen[-1] >= last:
                break
            _, seq, _, raw = self.recv()
            pub[seq] = raw
        self.assertEqual(max(self.seen), last)
        self.assertGreaterEqual(last, 5)
        self.assertNotIn(4, self.seen)  # the gap
        self.assertEqual(sorted(self.seen), [s for s in range(self.seen[0], last + 1) if s != 4])
        d = self.ctx.socket(zmq.DEALER)
        d.connect(self.rep)
        d.send_multipart([b"", (4).to_bytes(8, "big")])
        got = []
        for _ in range(100):
            self.assertTrue(d.poll(5000), "no replay answer")
            frames = d.recv_multipart()
            self.assertEqual(len(frames), 3, frames)
            self.assertEqual(frames[0], b"")
            if frames[1] == END_SEQ:
                self.assertEqual(frames[2], b"")
                break
            got.append((int.from_bytes(frames[1], "big"), frames[2]))
        else:
            self.fail("no end marker")
        self.assertEqual([s for s, _ in got], list(range(4, last + 1)))
        for s, raw in got:
            if s in pub:
                self.assertEqual(raw, pub[s])
        ev = msgpack.unpackb(got[0][1], raw=False)[1][0]
        self.assertIn(ev[0], ("BlockStored", "AllBlocksCleared"))
        # A request that is not 3 frames is ignored; the socket keeps serving.
        d.send_multipart([b"", b"x", b"y"])
        d.send_multipart([b"", (last + 1).to_bytes(8, "big")])
        self.assertTrue(d.poll(5000))
        self.assertEqual(d.recv_multipart(), [b"", END_SEQ, b""])
        m = prom_values(self.port)
        self.assertEqual(m["engine_sim_kv_events_replays_total"], 2)
        d.close(linger=0)

    def test_map_encoding(self):
        self.engine("--kv-events-encoding", "map")
        self.subscribe()
        self.complete(words(5, "m"))
        _, _, batch, _ = self.recv()
        self.assertEqual(set(batch), {"ts", "events", "data_parallel_rank"})
        ev = batch["events"][0]
        self.assertEqual(ev["type"], "BlockStored")
        self.assertEqual(ev["token_ids"], self.tokenize({"prompt": words(5, "m")})["tokens"][:4])
        self.assertEqual((ev["parent_block_hash"], ev["block_size"], ev["medium"]),
                         (None, BS, "GPU"))

    def test_tokenize(self):
        self.engine()
        other = start_engine_sim("both", ["--block-tokens", str(BS)])
        self.procs.append(other)
        prompt = "Hello, world! The cache-aware router keys by tokens: 42 of them."
        t1 = self.tokenize({"model": "sim-model", "prompt": prompt})
        self.assertEqual(set(t1), {"count", "max_model_len", "tokens", "token_strs"})
        self.assertEqual(t1["count"], len(t1["tokens"]))
        self.assertEqual(t1["max_model_len"], 4096 * BS)
        self.assertIsNone(t1["token_strs"])
        self.assertEqual(self.tokenize({"prompt": prompt}, other.port), t1)
        self.assertEqual(self.complete(prompt)["prompt_tokens"], t1["count"])
        msgs = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": prompt}]
        t2 = self.tokenize({"messages": msgs})
        self.assertEqual(self.tokenize({"messages": msgs}, other.port), t2)
        self.assertEqual(self.complete(msgs, chat=True)["prompt_tokens"], t2["count"])
        t3 = self.tokenize({"messages": msgs, "add_generation_prompt": False})
        self.assertLess(t3["count"], t2["count"])
        self.assertEqual(t2["tokens"][:t3["count"]], t3["tokens"])
        for doc, status in (({}, 400), ({"prompt": 5}, 400), ({"messages": []}, 400),
                            ({"prompt": "x", "model": "other"}, 404),
                            ({"prompt": "x", "return_token_strs": True}, 400),
                            ({"messages": msgs, "continue_final_message": True}, 400)):
            st, out = self.post("/tokenize", doc)
            self.assertEqual(st, status, doc)
            self.assertLessEqual({"message", "type", "code"}, set(out["error"]), out)
        r = http_request(self.port, "POST", "/tokenize", b"{", [])
        self.assertEqual(r.status, 400)
        r = http_request(self.port, "GET", "/tokenize")
        self.assertEqual(r.status, 405)
        r = http_request(self.port, "GET", "/reset_prefix_cache")
        self.assertEqual(r.status, 405)

    def test_prefill_charged_per_uncached_token(self):
        self.engine("--prefill-us-per-token", "10")
        prompt = words(40, "p")  # 40 tokens: 9 whole blocks before the last token's
        n = self.tokenize({"prompt": prompt})["count"]

        def counters():
            m = prom_values(self.port)
            return (m["engine_sim_prompt_tokens_computed_total"],
                    m["vllm:prefix_cache_hits_total"], m["vllm:prefix_cache_queries_total"],
                    m["vllm:prompt_tokens_total"])

        c0 = counters()
        u1 = self.complete(prompt)
        c1 = counters()
        u2 = self.complete(prompt)
        c2 = counters()
        self.assertEqual(u1["prompt_tokens_details"]["cached_tokens"], 0)
        self.assertEqual(u2["prompt_tokens_details"]["cached_tokens"], (n - 1) // BS * BS)
        first = [b - a for a, b in zip(c0, c1)]
        second = [b - a for a, b in zip(c1, c2)]
        self.assertEqual(first, [n, 0, n, n])
        self.assertEqual(second, [n - 36, 36, n, n])
        self.assertGreater(first[0], second[0])

    def test_bad_event_flags(self):
        port = free_port()
        busy = self.ctx.socket(zmq.PUB)
        busy.bind("tcp://%s:%d" % (HOST, port))
        for extra, want in ((["--kv-events-endpoint", "tcp://%s:%d" % (HOST, port)],
                             "--kv-events-endpoint"),
                            (["--kv-events-endpoint", "tcp://%s:%d" % (HOST, free_port()),
                              "--kv-events-replay-endpoint", "bogus://x"],
                             "--kv-events-replay-endpoint"),
                            (["--kv-events-endpoint", "tcp://%s:%d" % (HOST, free_port()),
                              "--kv-events-encoding", "json"], "--kv-events-encoding"),
                            (["--kv-events-drop-seq", "-2"], "--kv-events-drop-seq")):
            p = Proc("engine-sim-bad", [ENGINE_SIM, "--port", str(free_port())] + extra)
            self.procs.append(p)
            rc = p.proc.wait(timeout=10)
            self.assertNotEqual(rc, 0, extra)
            self.assertIn(want, p.log(), extra)
        busy.close(linger=0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
