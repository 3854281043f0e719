#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What current vLLM (the commit in pdkv/upstream.py) asks of the connector,
through the driver's engines (in this process, UCX between their agents):
  - hybrid models: a full-attention and a sliding-window group hand off
    together (request_finished_all_groups, remote_block_ids per group, the
    window clipped as NIXL clips it), byte-exact; a Mamba group is refused
    at start-up, clearly;
  - a load that fails on a hybrid model reaches vLLM as failed_recving (vLLM
    refuses invalid block ids there) and kv_load_failure_policy applies;
  - data-parallel engines: ports from data_parallel_index (vLLM resets
    data_parallel_rank to 0 in dense data-parallel engines);
  - every hand-off: a prefill that ends FINISHED_STOPPED (its one token was
    EOS) hands off; a prompt-embeds request (prompt_token_ids None) loads;
  - the transfers in vLLM's metrics (vllm:pdkv_*) and its log line;
  - kv_transfer_params naming a port out of range, a host outside the
    allowed producer networks, a closed port or a listener that is not a
    producer: nothing refused connects, and the request ends the same way
    for every one of them."""
import os
import socket
import threading
import unittest

import harness

harness.need_torch()
os.environ.update({k: v for k, v in harness.lib_env().items() if k.startswith(("PDKV", "KVC"))})
import driver  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from test_plugin_layouts import Local  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from pdkv.groups import UnsupportedModelError  # noqa: E402

HYBRID = ("full", ("swa", 32))


def metric(engine, name, **labels):
    """A sample's value from the engine's registry (None if absent)."""
    for fam in engine.e.registry.collect():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


class Vllm(unittest.TestCase):
    def pair(self, geo=None, pextra=None, dextra=None, tp=1):
        g = dict(layers=2, num_blocks=96)
        g.update(geo or {})
        p = Local("P", tp, driver.Geometry(**g), extra=pextra)
        self.addCleanup(p.close)
        d = Local("D", tp, driver.Geometry(**g), extra=dextra)
        self.addCleanup(d.close)
        return p, d

    def hand_off(self, p, d, prompt, rid, embeds=False):
        if embeds:
            preq = Request(rid + "p", None, 1, {"do_remote_decode": True}, prompt_embeds=prompt)
            dreq = lambda kv: Request(rid + "d", None, 3, dict(kv), prompt_embeds=prompt)  # noqa
        else:
            preq = Request(rid + "p", prompt, 1, {"do_remote_decode": True})
            dreq = lambda kv: Request(rid + "d", prompt, 3, dict(kv))  # noqa: E731
        ptok, kv, pst = self.run_req(p, preq)
        self.assertIsNotNone(kv, "prefill (%s) handed nothing off" % pst.name)
        dtok, _, dst = self.run_req(d, dreq(kv))
        return kv, ptok, dtok, dst

    def run_req(self, eng, req):
        return eng.run_req(req)

    def assert_verified(self, d, n):
        s = d.e.state()
        self.assertEqual((s["verified"], s["corrupt"], s["load_failed"]), (n, 0, 0),
                         (s, d.e.corrupt))

    # -- item: hybrid models -----------------------------------------------
    def test_hybrid_sliding_window(self):
        p, d = self.pair({"groups": HYBRID})
        for i, n in enumerate((10, 40, 150)):
            kv, ptok, dtok, st = self.hand_off(p, d, list(range(i, i + n)), "h%d" % i)
            self.assertEqual(st, RequestStatus.FINISHED_LENGTH_CAPPED)
            self.assertEqual(dtok[0], ptok[0])
            full, swa = kv["remote_block_ids"]
            self.assertEqual(len(full), (n + 15) // 16)
            self.assertLessEqual(len(swa), 32 // 16 + 1)  # cdiv(window, block) + 1
            self.assertNotIn(0, swa)                       # no null-block padding
        self.assert_verified(d, 3)
        bad, never = d.e.untouched()
        self.assertEqual(bad, [])

    def test_mamba_refused(self):
        with self.assertRaises(UnsupportedModelError) as cm:
            driver.Engine("M", geo=driver.Geometry(groups=("full", "mamba")),
                          port=harness.free_ports(1))
        self.assertIn("MambaSpec", str(cm.exception))
        self.assertIn("not supported", str(cm.exception))

    def test_hybrid_failed_load_is_failed_recving(self):
        p, d = self.pair({"groups": HYBRID})
        prompt = list(range(50))
        _, kv, _ = self.run_req(p, Request("fp", prompt, 1, {"do_remote_decode": True}))
        bad = dict(kv, remote_kv_token="0" * 32)
        toks, _, st = self.run_req(d, Request("fd", prompt, 3, bad))
        self.assertEqual((toks, st), ([], RequestStatus.FINISHED_ERROR))
        self.assertEqual(d.e.state()["load_failed"], 1)
        self.assertEqual(metric(d, "vllm:pdkv_num_failed_transfers_total"), 1.0)

    # -- item: data-parallel ports -------------------------------------------
    def test_data_parallel_engines_get_their_own_ports(self):
        base = harness.free_ports(4)
        engines = []
        try:
            for dp in (0, 1):
                engines.append(driver.Engine("DP%d" % dp, tp=2, port=base, dp_index=dp,
                                             geo=driver.Geometry(num_blocks=16)))
            ports = [r.conn.worker.agent.port for e in engines for r in e.ranks]
            self.assertEqual(ports, [base, base + 1, base + 2, base + 3])
        finally:
            for e in engines:
                e.shutdown()

    # -- item: every hand-off ------------------------------------------------
    def test_stopped_prefill_hands_off(self):
        p, d = self.pair()
        p.e.stop_after_first = True   # its one token is EOS
        kv, ptok, dtok, st = self.hand_off(p, d, list(range(40)), "s")
        self.assertEqual((st, dtok[0]), (RequestStatus.FINISHED_LENGTH_CAPPED, ptok[0]))
        self.assert_verified(d, 1)

    def test_prompt_embeds(self):
        p, d = self.pair()
        kv, ptok, dtok, st = self.hand_off(p, d, list(range(7, 47)), "e", embeds=True)
        self.assertEqual((st, dtok[0]), (RequestStatus.FINISHED_LENGTH_CAPPED, ptok[0]))
        self.assert_verified(d, 1)

    # -- item: failures and figures inside vLLM ----------------------------------
    def test_metrics(self):
        p, d = self.pair()
        for i in range(3):
            self.hand_off(p, d, list(range(i, i + 40)), "m%d" % i)
        text = generate_latest(d.e.registry).decode()
        self.assertIn('vllm:pdkv_xfer_time_seconds_count{engine="0",model_name="pdkv-test"} 3.0',
                      text)
        nbytes = metric(d, "vllm:pdkv_bytes_transferred_sum")
        # 3 loads x 3 blocks x 2 layers x 2 planes x 16 tokens x 4 heads x 8 x 2 bytes
        self.assertEqual(nbytes, 3 * 3 * 2 * 2 * 16 * 4 * 8 * 2)
        self.assertEqual(metric(d, "vllm:pdkv_num_blocks_sum"), 9.0)
        self.assertEqual(metric(d, "vllm:pdkv_num_failed_transfers_total"), 0.0)
        self.assertTrue(any(line.get("Num successful transfers") for line in d.e.log_lines),
                        d.e.log_lines)
        self.assertGreater(min(line["Throughput (MB/s)"] for line in d.e.log_lines
                               if line["Num successful transfers"]), 0)

    # -- issue 39: what pdkv is told to connect to ---------------------------------
    def test_refused_targets_fail_alike(self):
        p, d = self.pair(dextra={"allowed_producer_networks": ["127.0.0.0/8"],
                                 "connect_timeout_ms": 1000, "fetch_wait_ms": 1000,
                                 "xfer_timeout_ms": 1000})
        prompt = list(range(30))
        _, kv, _ = self.run_req(p, Request("tp", prompt, 1, {"do_remote_decode": True}))
        closed = harness.free_ports(1)
        lsock = socket.socket()   # a listener that is not a producer
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(8)
        self.addCleanup(lsock.close)
        accepted = []

        def accept():
            while True:
                try:
                    c, _ = lsock.accept()
                except OSError:
                    return
                accepted.append(c)
        threading.Thread(target=accept, daemon=True).start()
        targets = {
            "wrapped port": dict(kv, remote_port=65536 + p.e.ranks[0].conn.worker.agent.port),
            "port 0": dict(kv, remote_port=0),
            "port as text": dict(kv, remote_port=str(kv["remote_port"])),
            "metadata address": dict(kv, remote_host="169.254.169.254"),
            "public address": dict(kv, remote_host="8.8.8.8"),
            "host list": dict(kv, remote_host=["127.0.0.1"]),
            "closed port": dict(kv, remote_port=closed),
            "not a producer": dict(kv, remote_port=lsock.getsockname()[1]),
        }
        handshakes = p.e.ranks[0].conn.worker.agent.stat("handshakes")
        outcomes = {}
        for i, (what, params) in enumerate(targets.items()):
            toks, out, st = self.run_req(d, Request("t%d" % i, prompt, 3, params))
            outcomes[what] = (toks, out, st)
        self.assertEqual(set(map(repr, outcomes.values())),
                         {repr(([], None, RequestStatus.FINISHED_ERROR))}, outcomes)
        # nothing reached the producer; the listener saw only the one it was named for
        self.assertEqual(p.e.ranks[0].conn.worker.agent.stat("handshakes"), handshakes)
        self.assertEqual(p.e.state()["published_now"], 1)
        self.assertLessEqual(len(accepted), 1)
        # and the honest params still load
        toks, _, st = self.run_req(d, Request("tok", prompt, 3, dict(kv)))
        self.assertEqual(st, RequestStatus.FINISHED_LENGTH_CAPPED)

    def test_names_resolve_and_are_checked(self):
        p, d = self.pair(dextra={"allowed_producer_networks": "127.0.0.0/8, ::1/128"})
        prompt = list(range(20))
        _, kv, _ = self.run_req(p, Request("np", prompt, 1, {"do_remote_decode": True}))
        toks, _, st = self.run_req(d, Request("nd", prompt, 3, dict(kv, remote_host="localhost")))
        self.assertEqual(st, RequestStatus.FINISHED_LENGTH_CAPPED)
        self.assert_verified(d, 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
