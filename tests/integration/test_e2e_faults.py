# SPDX-License-Identifier: Apache-2.0
"""End to end, when things go wrong: a relay that loses remote_request_id
(the check that blocks are released must be able to fail), and a prefill
killed in the middle of a run."""
import concurrent.futures
import http.client
import http.server
import json
import threading
import time
import unittest

from pdharness.client import post_json
from pdharness.cluster import ClusterCase
from pdharness.net import HOST, wait_for
from pdharness.procs import start_engine_sim, start_sim_proxy
from pdharness.prom import prom_values


class DroppingRelay:
    """Forwards POSTs to a prefill and deletes remote_request_id from the
    kv_transfer_params of its answers."""

    def __init__(self, target_port):
        target = target_port

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(n)
                c = http.client.HTTPConnection(HOST, target, timeout=30)
                c.request("POST", self.path, body=body, headers={
                    "Content-Type": "application/json",
                    "X-Request-Id": self.headers.get("X-Request-Id", "")})
                r = c.getresponse()
                doc = json.loads(r.read())
                c.close()
                doc.get("kv_transfer_params", {}).pop("remote_request_id", None)
                out = json.dumps(doc).encode()
                self.send_response(r.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class LostRequestIdTest(ClusterCase):
    def test_without_remote_request_id_blocks_expire_instead_of_release(self):
        p = self.start(start_engine_sim("prefill", ["--kv-expiry-ms", "1500"]))
        d = self.start(start_engine_sim("decode"))
        relay = DroppingRelay(p.port)
        self.addCleanup(relay.close)
        px = self.start(start_sim_proxy([relay.port], [d.port]))
        n = 10
        for i in range(n):
            st, _, raw = post_json(px.port, "/v1/completions",
                                   {"prompt": "lost ids %d " % i + "x " * 40, "max_tokens": 4})
            self.assertEqual(st, 200, raw)
        # Decode could not use the params: it recomputed, and never notified.
        dm = prom_values(d.port)
        self.assertEqual(dm["engine_sim_invalid_kv_transfer_params_total"], n)
        self.assertEqual(dm["engine_sim_kv_fetches_total"], 0)
        # pdproxy warned about every one of them.
        self.assertEqual(px.log().count("remote_request_id"), n)

        def expired():
            m = prom_values(p.port)
            return (m["engine_sim_kv_blocks_published_total"] > 0 and
                    m["engine_sim_kv_blocks_expired_total"] ==
                    m["engine_sim_kv_blocks_published_total"]), m
        m = wait_for(expired, 15, "prefill blocks to expire")
        self.assertEqual(m["engine_sim_kv_blocks_released_by_consumer_total"], 0)
        self.assertIn("Releasing expired KV blocks", p.log())


class KilledPrefillTest(ClusterCase):
    def test_killed_prefill_hangs_no_request_and_survivors_serve(self):
        p1 = self.start(start_engine_sim("prefill", ["--ttft-ms", "20"]))
        p2 = self.start(start_engine_sim("prefill", ["--ttft-ms", "20"]))
        d = self.start(start_engine_sim("decode", ["--itl-ms", "5"]))
        px = self.start(start_sim_proxy([p1.port, p2.port], [d.port], ["--connect-timeout", "1"]))
        results = []
        lock = threading.Lock()
        stop_at = [time.monotonic() + 60.0]  # set to 2.5 s after the kill below

        def client(k):
            i = 0
            while time.monotonic() < stop_at[0] and i < 400:
                i += 1
                t0 = time.monotonic()
                st, hdrs, raw = post_json(px.port, "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "client %d request %d " % (k, i) * 20}],
                    "max_tokens": 8, "stream": bool(i % 2)}, timeout=30)
                with lock:
                    results.append((t0, time.monotonic() - t0, st, raw))

        def served(p):
            return prom_values(p.port).get("engine_sim_requests_total", 0)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(client, k) for k in range(8)]
            # Killed once both prefills are serving the clients, in the midst of it.
            try:
                wait_for(lambda: (served(p1) >= 10 and served(p2) >= 10, (served(p1), served(p2))),
                         30, "both prefills to serve 10 requests")
            except AssertionError:
                stop_at[0] = 0.0
                raise
            t_kill = time.monotonic()
            p1.kill()
            stop_at[0] = t_kill + 2.5
            for f in futs:
                f.result(timeout=60)
        self.assertTrue(results)
        # Nothing hung: every request ended well inside the client's timeout.
        self.assertLess(max(r[1] for r in results), 10.0)
        # Failures are proper errors: 502 with OpenAI-style JSON naming the prefill.
        for t0, dt, st, raw in results:
            if st != 200:
                self.assertEqual(st, 502, raw)
                err = json.loads(raw)["error"]
                self.assertIn("prefill", err["message"])
                self.assertEqual(err["code"], 502)
        after = [r for r in results if r[0] > t_kill + 0.2]
        self.assertTrue(any(r[2] == 200 for r in after), "survivors keep serving")
        self.assertTrue(d.alive() and p2.alive() and px.alive())
        # The surviving prefill's blocks were all released.
        wait_for(lambda: (prom_values(p2.port)["vllm:kv_cache_usage_perc"] == 0, None), 10,
                 "surviving prefill's blocks released")


if __name__ == "__main__":
    unittest.main(verbosity=2)
