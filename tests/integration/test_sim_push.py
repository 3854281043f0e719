#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""engine-sim in push mode (vLLM's push connector, what `--dispatch
concurrent` will send): the caller mints the request id and token and sends
prefill and decode their requests at the same time. Prefill publishes under
that id and token; decode, given do_remote_prefill without
remote_block_ids, registers a held fetch at prefill at once and is served
the moment prefill publishes (the publication's last blocks). Real KV moves
between two engine-sims; the answer is the serial flow's, byte for byte."""

import http.client
import json
import secrets
import socket
import threading

from pdharness.case import main
from pdharness.client import post_json
from pdharness.net import wait_until, wait_value
from pdharness.pd import PdCase, prose, rid_headers

PROMPT = prose(3000, seed=5)
# What the prefill's connector logs (debug) when a decode's fetch arrives
# before the publication and is held for it.
HELD = "held until its publication"


class SimPushTest(PdCase):

    def pair(self):
        # Debug logs: prefill says when it holds a fetch (push() waits for it).
        P = self.engine("prefill", ["--kv-transfer-mode", "push", "--log-level", "debug"])
        D = self.engine("decode", ["--kv-transfer-mode", "push"])
        return P, D

    def serial(self, P, D, rid):
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8}
        st, _, raw = post_json(P.port, "/v1/completions",
                               dict(body, max_tokens=1,
                                    kv_transfer_params={"do_remote_decode": True}),
                               headers=rid_headers(rid + "-p"))
        self.assertEqual(st, 200, raw)
        kvp = json.loads(raw)["kv_transfer_params"]
        st, _, raw = post_json(D.port, "/v1/completions", dict(body, kv_transfer_params=kvp),
                               headers=rid_headers(rid + "-d"))
        self.assertEqual(st, 200, raw)
        # Decode's prefix cache now holds the prompt: forget it, so that
        # the push leg moves every block again.
        st, _, _ = post_json(D.port, "/reset_prefix_cache", {})
        self.assertEqual(st, 200)
        return kvp, json.loads(raw)

    def push(self, P, D, ident, rid, token=None, p_token=None, decode_first=True, p_prompt=None):
        """Sends both legs at once (decode first: its fetch is held at
        prefill); returns (prefill answer, decode answer) as (status, doc)."""
        req_id = "push-" + secrets.token_hex(8)
        token = token or secrets.token_hex(16)
        self.last = (req_id, token)
        p_kvp = {"do_remote_decode": True, "remote_request_id": req_id,
                 "remote_kv_token": p_token or token, "transfer_mode": "push"}
        d_kvp = {"do_remote_prefill": True, "remote_request_id": req_id,
                 "remote_kv_token": token, "transfer_mode": "push",
                 "remote_engine_id": ident["remote_engine_id"],
                 "remote_host": ident["remote_host"], "remote_port": ident["remote_port"],
                 "tp_size": ident.get("tp_size", 1)}
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8}
        out = {}

        def leg(name, port, b):
            out[name] = post_json(port, "/v1/completions", b, headers=rid_headers(rid + name))
        td = threading.Thread(target=leg, args=("d", D.port, dict(body, kv_transfer_params=d_kvp)))
        tp = threading.Thread(target=leg, args=("p", P.port, dict(body, max_tokens=1,
                                                                   prompt=p_prompt or PROMPT,
                                                                   kv_transfer_params=p_kvp)))
        first, second = (td, tp) if decode_first else (tp, td)
        held = P.log().count(HELD)
        first.start()
        if decode_first:
            # Decode's registration reaches prefill before it publishes (it
            # would be served either way; this exercises the held path).
            self.assertTrue(wait_until(lambda: P.log().count(HELD) > held, 10.0, 0.01),
                            "decode's fetch never held at prefill:\n" + P.log()[-3000:])
        second.start()
        for t in (td, tp):
            t.join(60)
            self.assertFalse(t.is_alive())
        self.d_headers = out["d"][1]
        return [(out[k][0], json.loads(out[k][2])) for k in ("p", "d")]

    def published_left(self, P):
        m = lambda n: self.engine_metric(P.port, n) or 0
        return (m("engine_sim_kv_blocks_published_total")
                - m("engine_sim_kv_blocks_released_by_consumer_total")
                - m("engine_sim_kv_blocks_expired_total"))

    def wait_released(self, P):
        self.assertEqual(wait_value(lambda: self.published_left(P), lambda n: n == 0, 5.0, 0.05),
                         0)

    def test_push_answers_as_serial_and_moves_kv(self):
        P, D = self.pair()
        ident, ser = self.serial(P, D, "s1")
        bytes0 = self.engine_metric(D.port, "engine_sim_kv_bytes_fetched_total")
        self.assertGreater(bytes0, 0)
        (pst, pdoc), (dst, ddoc) = self.push(P, D, ident, "c1")
        self.assertEqual((pst, dst), (200, 200), (pdoc, ddoc))
        # Prefill published under the caller's id and token.
        self.assertEqual((pdoc["kv_transfer_params"]["remote_request_id"],
                          pdoc["kv_transfer_params"]["remote_kv_token"]), self.last)
        self.assertEqual(ddoc["choices"], ser["choices"])
        self.assertEqual(ddoc["usage"], ser["usage"])
        # Decode reports how long it waited for the KV (prefill included).
        wait = {k.lower(): v for k, v in self.d_headers.items()}.get("x-kv-wait-ms")
        self.assertIsNotNone(wait, self.d_headers)
        self.assertGreaterEqual(float(wait), 0.0)
        # Real KV moved again (as many bytes as the serial fetch), nothing
        # was recomputed, and prefill let its blocks go.
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_bytes_fetched_total"),
                         2 * bytes0)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetches_total"), 2)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetch_failures_total"), 0,
                         D.log()[-3000:] + P.log()[-3000:])
        self.assertEqual(ddoc["usage"]["prompt_tokens_details"]["cached_tokens"],
                         ddoc["usage"]["prompt_tokens"] - 1)
        self.wait_released(P)

    def test_prefill_first_also_served(self):
        P, D = self.pair()
        ident, ser = self.serial(P, D, "s2")
        (pst, _), (dst, ddoc) = self.push(P, D, ident, "c2", decode_first=False)
        self.assertEqual((pst, dst), (200, 200))
        self.assertEqual(ddoc["choices"], ser["choices"])
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetch_failures_total"), 0,
                         D.log()[-3000:] + P.log()[-3000:])
        self.wait_released(P)

    def test_wrong_token_refused_decode_recomputes(self):
        """Prefill publishes with another token than decode registered: the
        held fetch is refused, decode recomputes (its default policy) and
        answers the same text; prefill's blocks are not handed to it."""
        P, D = self.pair()
        ident, ser = self.serial(P, D, "s3")
        (pst, _), (dst, ddoc) = self.push(P, D, ident, "c3", p_token=secrets.token_hex(16))
        self.assertEqual((pst, dst), (200, 200))
        self.assertEqual(ddoc["choices"], ser["choices"])
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetch_failures_total"), 1)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetches_total"), 1)

    def test_more_blocks_than_published_refused(self):
        """Prefill published fewer blocks than decode's prompt needs (another
        prompt under the same id): the producer refuses the held fetch rather
        than send blocks decode did not ask for; decode recomputes."""
        P, D = self.pair()
        ident, ser = self.serial(P, D, "s6")
        (pst, _), (dst, ddoc) = self.push(P, D, ident, "c6", p_prompt=PROMPT[:600])
        self.assertEqual((pst, dst), (200, 200))
        self.assertEqual(ddoc["choices"], ser["choices"])
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetch_failures_total"), 1)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetches_total"), 1)
        self.assertEqual(ddoc["usage"]["prompt_tokens_details"]["cached_tokens"], 0)

    def test_decode_client_leaves_while_prefill_runs(self):
        """Decode's client leaves while its fetch is held at prefill: the
        fetch is still served when prefill publishes (so prefill's blocks
        are released, not stranded), and decode drops the request."""
        P = self.engine("prefill", ["--ttft-ms", "300", "--log-level", "debug",
                                    "--kv-transfer-mode", "push"])
        D = self.engine("decode", ["--kv-transfer-mode", "push"])
        ident, _ = self.serial(P, D, "s5")
        req_id, token = "push-" + secrets.token_hex(8), secrets.token_hex(16)
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8}
        d_body = dict(body, kv_transfer_params={
            "do_remote_prefill": True, "remote_request_id": req_id, "remote_kv_token": token,
            "transfer_mode": "push", "remote_engine_id": ident["remote_engine_id"],
            "remote_host": ident["remote_host"], "remote_port": ident["remote_port"],
            "tp_size": 1})
        c = http.client.HTTPConnection("127.0.0.1", D.port, timeout=10)
        held = P.log().count(HELD)
        c.request("POST", "/v1/completions", body=json.dumps(d_body),
                  headers={"Content-Type": "application/json"})
        # Decode's client leaves once its fetch is held at prefill.
        self.assertTrue(wait_until(lambda: P.log().count(HELD) > held, 10.0, 0.01),
                        "decode's fetch never held at prefill:\n" + P.log()[-3000:])
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        st, _, raw = post_json(P.port, "/v1/completions", dict(body, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "remote_request_id": req_id, "remote_kv_token": token,
            "transfer_mode": "push"}))
        self.assertEqual(st, 200, raw)
        self.wait_released(P)
        # The fetch reached prefill before its publication and was held.
        self.assertIn("held until its publication", P.log())
        self.assertIn("served on publish", P.log())
        self.assertEqual(wait_value(lambda: self.engine_metric(D.port, "vllm:num_requests_running"),
                                    lambda n: n == 0, 5.0, 0.05), 0)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetches_total"), 2)

    def test_push_without_identity_is_invalid(self):
        """do_remote_prefill in push mode still needs prefill's identity."""
        P, D = self.pair()
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8,
                "kv_transfer_params": {"do_remote_prefill": True, "transfer_mode": "push",
                                       "remote_request_id": "x",
                                       "remote_kv_token": secrets.token_hex(16)}}
        st, _, raw = post_json(D.port, "/v1/completions", body)
        self.assertEqual(st, 200, raw)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_invalid_kv_transfer_params_total"),
                         1)


if __name__ == "__main__":
    main()
