# SPDX-License-Identifier: Apache-2.0
"""End to end: pdproxy + 2 prefill + 2 decode engine-sims, KV blocks moved by
libkvconnector over UCX tcp on loopback, answers compared with a --role both
engine computing the same prompts locally."""
import concurrent.futures
import json
import random
import threading
import unittest

from pdharness.client import answer_text, post_json
from pdharness.cluster import ClusterCase
from pdharness.net import wait_for
from pdharness.procs import start_engine_sim, start_sim_proxy
from pdharness.prom import prom_values

WORDS = ("alpha beta gamma delta kv cache block prefill decode token stream proxy "
         "engine layer head value key tensor memory route fast slow").split()


def make_request(rng, i):
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    # Prompt sizes from 1 to 3000 tokens, most short, some long.
    n = rng.choice([1, 2, 15, 16, 17, 100, 500, 1000, 2000, 3000, rng.randint(1, 3000)])
    prompt = " ".join(rng.choice(WORDS) for _ in range(n))
    body = {"model": "sim-model", "max_tokens": rng.randint(1, 24)}
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 10**6)
    if chat:
        # The chat template adds tokens of its own; keep the total near n.
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return path, body, stream


class MixedLoadTest(ClusterCase):
    def test_200_mixed_requests_match_local_and_release_every_block(self):
        ps = [self.start(start_engine_sim("prefill")) for _ in range(2)]
        ds = [self.start(start_engine_sim("decode")) for _ in range(2)]
        ref = self.start(start_engine_sim("both"))
        px = self.start(start_sim_proxy([p.port for p in ps], [d.port for d in ds]))

        rng = random.Random(20261202)
        reqs = [make_request(rng, i) for i in range(200)]
        lock = threading.Lock()
        failures = []

        def run(req):
            path, body, stream = req
            st, hdrs, raw = post_json(px.port, path, body, stream)
            if st != 200:
                with lock:
                    failures.append((path, st, raw[:300]))
                return
            if stream:
                assert hdrs.get("Content-Type", "").startswith("text/event-stream"), hdrs
            got = answer_text(path, raw, stream)
            st2, _, raw2 = post_json(ref.port, path, dict(body, stream=False))
            want = answer_text(path, raw2, False)
            if got != want:
                with lock:
                    failures.append((path, "text differs", got, want))

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for f in [pool.submit(run, r) for r in reqs]:
                f.result(timeout=120)
        self.assertEqual(failures, [])

        # Every published block is released by its consumer's notification.
        def released():
            ms = [prom_values(p.port) for p in ps]
            pub = sum(m["engine_sim_kv_blocks_published_total"] for m in ms)
            rel = sum(m["engine_sim_kv_blocks_released_by_consumer_total"] for m in ms)
            return pub > 0 and pub == rel, (pub, rel)
        pub, rel = wait_for(released, 20, "prefill blocks released")
        for p in ps:
            m = prom_values(p.port)
            self.assertEqual(m["engine_sim_kv_blocks_expired_total"], 0)
            self.assertEqual(m["engine_sim_kv_unknown_notifications_total"], 0)
            self.assertEqual(m["vllm:kv_cache_usage_perc"], 0)
        fetches = 0
        for d in ds:
            m = prom_values(d.port)
            self.assertEqual(m["engine_sim_kv_corrupt_blocks_total"], 0)
            self.assertEqual(m["engine_sim_kv_fetch_failures_total"], 0)
            self.assertEqual(m["engine_sim_invalid_kv_transfer_params_total"], 0)
            self.assertEqual(m["vllm:kv_cache_usage_perc"], 0)
            fetches += m["engine_sim_kv_fetches_total"]
        self.assertEqual(fetches, len(reqs), "every request's blocks were fetched by decode")


class SingleRequestTest(ClusterCase):
    def test_ids_differ_and_decode_notifies_by_remote_request_id(self):
        p = self.start(start_engine_sim("prefill"))
        d = self.start(start_engine_sim("decode"))
        # Ask prefill directly, as the proxy would, to see its internal id.
        st, _, raw = post_json(p.port, "/v1/completions", {
            "prompt": "a b c d e f g h i j k l m n o p q r", "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
            headers={"X-Request-Id": "req-42"})
        self.assertEqual(st, 200)
        kvp = json.loads(raw)["kv_transfer_params"]
        self.assertTrue(kvp["remote_request_id"].startswith("cmpl-req-42-"))
        self.assertEqual([len(g) for g in kvp["remote_block_ids"]], [2])  # per KV-cache group
        st, _, raw = post_json(d.port, "/v1/completions", {
            "prompt": "a b c d e f g h i j k l m n o p q r", "max_tokens": 3,
            "kv_transfer_params": kvp}, headers={"X-Request-Id": "req-42"})
        self.assertEqual(st, 200, raw)
        wait_for(lambda: (prom_values(p.port)["engine_sim_kv_blocks_released_by_consumer_total"]
                          == 2, None), 10, "release by notification")
        self.assertIn("kv fetch done", d.log())


if __name__ == "__main__":
    unittest.main(verbosity=2)
