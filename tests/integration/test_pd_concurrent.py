#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""--dispatch concurrent: both P/D legs at once for a push connector.

pdproxy mints the request id ("pdproxy-" + 32 hex) and the publication
token (32 hex), tells prefill to publish under them and decode where to
register for them (the prefill's identity, learned from that prefill's
earlier answers: until then the request goes serial, reason no_identity),
and sends both requests at once. Scriptable mocks decide the order of the
race and every failure; engine-sims in push mode move real KV. Every wait
is bounded."""

import json
import os
import re
import subprocess
import threading
import time
import unittest

from pdharness.case import main
from pdharness.client import RawClient, http_request, post_json
from pdharness.ctl import pools_yaml, sighup, tmpdir, wait_generation, write_yaml
from pdharness.mocks import (MOCK_TLS, Hang, Reset, Respond, Stream, chat_body, completion_body,
                             decode_handler, default_p_kv, prefill_handler, sse_events)
from pdharness.net import wait_value
from pdharness.pd import PdCase, prose, rid_headers
from pdharness.net import read_by_peer, wait_until
from pdharness.procs import PDPROXY, start_engine_sim

CONC = ["--dispatch", "concurrent"]
PUSH = ["--kv-transfer-mode", "push"]  # engine-sim as vLLM's NixlPushConnector
HEX32 = re.compile(r"^[0-9a-f]{32}$")
WAIT = 5.0  # the longest any scripted leg waits for the other


def kvp_of(req):
    return req.json().get("kv_transfer_params")


def is_push(req):
    """A leg of a concurrent dispatch (a serial decode's params, prefill's
    answer, say "transfer_mode":"push" too, but carry no minted token)."""
    kvp = kvp_of(req) or {}
    return kvp.get("transfer_mode") == "push" and "remote_kv_token" in kvp


class Gate:
    """An event one mock sets and the other waits for (bounded)."""

    def __init__(self):
        self.ev = threading.Event()
        self.seen = None  # whether the waiter saw it set in time

    def set(self):
        self.ev.set()

    def wait(self):
        self.seen = self.ev.wait(WAIT)
        return self.seen


class ConcurrentMockTest(PdCase):

    def learned(self, P, D, extra=(), d_handler=None):
        """pdproxy in concurrent mode over P and D; one first request runs
        serial (no identity yet) and teaches pdproxy P's identity."""
        px = self.start_proxy([P], [D], extra=CONC + list(extra))
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers=rid_headers("learn"))
        self.assertEqual(r.status, 200, r.body)
        rec = self.access_for(px, "learn")
        self.assertEqual(rec["dispatch"], "serial")
        self.assertEqual(self.metric(px, "pdproxy_dispatch_total", mode="serial",
                                     reason="no_identity"), 1)
        return px

    def test_no_identity_serial_then_concurrent_with_minted_ids(self):
        gate = Gate()
        p_base = prefill_handler(mode="push")
        d_base = decode_handler()

        def p(req):
            # Concurrent: decode's request arrives while prefill still works.
            if is_push(req):
                gate.wait()
            return p_base(req)

        def d(req):
            if is_push(req):
                gate.set()
            return d_base(req)
        P = self.mock(p, name="P")
        D = self.mock(d, name="D")
        px = self.learned(P, D)
        # The serial request: decode got prefill's own kv_transfer_params.
        self.assertEqual(kvp_of(D.requests[0])["remote_block_ids"], [1, 2, 4])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers=rid_headers("c1"))
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(json.loads(r.body)["choices"][0]["text"], "decoded:1")
        # The access line is written once the prefill leg ended too.
        rec = self.access_for(px, "c1")
        self.assertTrue(gate.seen, "prefill answered before decode's request arrived")
        pk, dk = kvp_of(P.requests[1]), kvp_of(D.requests[1])
        self.assertTrue(pk["do_remote_decode"])
        self.assertEqual(pk["transfer_mode"], "push")
        self.assertRegex(pk["remote_request_id"], r"^pdproxy-[0-9a-f]{32}$")
        self.assertRegex(pk["remote_kv_token"], HEX32)
        self.assertEqual(P.requests[1].json()["max_tokens"], 1)
        self.assertIs(P.requests[1].json()["stream"], False)
        want = dict(default_p_kv("learn"))
        self.assertEqual(dk, {"do_remote_prefill": True, "do_remote_decode": False,
                              "transfer_mode": "push",
                              "remote_engine_id": want["remote_engine_id"],
                              "remote_request_id": pk["remote_request_id"],
                              "remote_kv_token": pk["remote_kv_token"],
                              "remote_host": want["remote_host"],
                              "remote_port": want["remote_port"], "tp_size": 1,
                              "transfer_id": pk["transfer_id"]})
        self.assertRegex(pk["transfer_id"], r"^xfer-[0-9a-f]{32}$")
        self.assertEqual(D.requests[1].json()["max_tokens"], 16)
        self.assertEqual((rec["dispatch"], rec["decision"]), ("concurrent", "disaggregated"))
        self.assertEqual(self.metric(px, "pdproxy_dispatch_total", mode="concurrent",
                                     reason="identity_cached"), 1)
        # Each request mints its own id and token.
        http_request(px.port, "POST", "/v1/completions", completion_body(),
                     headers=rid_headers("c2"))
        self.access_for(px, "c2")  # written once the prefill leg ended
        pk2 = kvp_of(P.requests[2])
        self.assertNotEqual(pk2["remote_request_id"], pk["remote_request_id"])
        self.assertNotEqual(pk2["remote_kv_token"], pk["remote_kv_token"])
        self.assertNotEqual(pk2["transfer_id"], pk["transfer_id"])

    def test_pull_prefill_is_sent_serial(self):
        """A prefill whose answers say "transfer_mode":"pull" (vLLM's
        NixlConnector writes it since PR #50620) is never sent both legs at
        once: decode would get do_remote_prefill without remote_block_ids,
        which vLLM's pull scheduler asserts on (its engine core dies). Every
        decode request carries prefill's block ids; the reason is counted.
        A prefill that names no transfer_mode (older engines) goes serial
        too: only a push prefill can take both legs at once."""
        for mode, reason in (("pull", "prefill_pulls"), (None, "mode_unknown")):
            P = self.mock(prefill_handler(mode=mode), name="P")
            D = self.mock(decode_handler(), name="D")
            px = self.start_proxy([P], [D], extra=CONC)
            for i in range(4):
                rid = "%s%d" % (mode, i)
                r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                                 headers=rid_headers(rid))
                self.assertEqual(r.status, 200, r.body)
                self.assertEqual(self.access_for(px, rid)["dispatch"], "serial")
            self.assertEqual(len(D.requests), 4)
            wrong = [q for q in D.requests if "remote_block_ids" not in kvp_of(q)]
            self.assertEqual(len(wrong), 0, "decode got no remote_block_ids %d times of 4"
                             % len(wrong))
            for q in P.requests:
                self.assertNotIn("remote_kv_token", kvp_of(q))
            self.assertEqual(self.metric(px, "pdproxy_dispatch_total", mode="serial",
                                         reason="no_identity"), 1)
            self.assertEqual(self.metric(px, "pdproxy_dispatch_total", mode="serial",
                                         reason=reason), 3)

    def test_prefill_answers_before_decode_arrives(self):
        """The other order: prefill has answered (and would have published)
        before decode's request is read; decode's answer still streams."""
        gate = Gate()
        p_base = prefill_handler(mode="push")

        def p(req):
            out = p_base(req)
            gate.set()
            return out

        d_base = decode_handler()
        seen = []  # prefill's ok answers pdproxy had counted when decode answered

        def d(req):
            if not is_push(req):
                return d_base(req)
            gate.wait()
            # Prefill's answer reached pdproxy (its leg ended: the learning
            # request's and this one's) before decode answers.
            ok = lambda: self.metric(px, "pdproxy_upstream_requests_total", role="prefill",
                                     outcome="ok") or 0
            seen.append(wait_value(ok, lambda n: n >= 2, WAIT))
            return Stream(200, [("Content-Type", "text/event-stream"),
                                ("X-KV-Wait-Ms", "12.5")],
                          [(0.0, c) for c in sse_events(["a", "b"])])
        P = self.mock(p, name="P")
        D = self.mock(d, name="D")
        px = self.learned(P, D)
        r = http_request(px.port, "POST", "/v1/chat/completions", chat_body(stream=True),
                         headers=rid_headers("c3"))
        self.assertEqual(r.status, 200)
        self.assertEqual(r.body, b"".join(sse_events(["a", "b"])))
        self.assertTrue(gate.seen)
        self.assertGreaterEqual(seen[0], 2, "prefill's answer not counted before decode answered")
        rec = self.access_for(px, "c3")
        self.assertEqual(rec["dispatch"], "concurrent")
        self.assertEqual(rec["kv_wait_ms"], "12.50")
        self.assertEqual(self.metric(px, "pdproxy_decode_kv_wait_seconds_count"), 1)
        self.assertAlmostEqual(self.metric(px, "pdproxy_decode_kv_wait_seconds_sum"), 0.0125,
                               places=4)

    def fail_prefill_setup(self, action, fallback, extra=()):
        """P learns, then fails the concurrent leg with `action` once decode's
        request arrived; D hangs on the push request (waiting for KV that
        never comes) and answers a request without kv_transfer_params."""
        gate = Gate()
        p_base = prefill_handler(mode="push")
        d_base = decode_handler()
        state = {"n": 0}

        def p(req):
            if is_push(req):
                gate.wait()
                return action()
            return p_base(req)

        def d(req):
            if is_push(req):
                gate.set()
                return Hang(WAIT * 2)
            return d_base(req)
        P = self.mock(p, name="P")
        D = self.mock(d, name="D")
        px = self.learned(P, D, extra=(["--fallback-decode-only"] if fallback else []) +
                          ["--prefill-retries", "0"] + list(extra))
        return px, P, D, state

    def check_decode_cancelled(self, D, n_before):
        push = [q for q in D.requests[n_before:] if is_push(q)]
        self.assertEqual(len(push), 1)
        self.assertIsNotNone(push[0].conn.wait_closed(WAIT), "decode's leg was not cancelled")
        self.assertTrue(push[0].conn.closed_by_peer)

    def test_prefill_5xx_falls_back_to_decode_alone(self):
        px, P, D, _ = self.fail_prefill_setup(
            lambda: Respond(503, [("Content-Type", "application/json")], b'{"error":"x"}'), True)
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers=rid_headers("f1"))
        self.assertEqual(r.status, 200, r.body)
        self.check_decode_cancelled(D, 1)
        last = D.requests[-1].json()
        self.assertNotIn("kv_transfer_params", last)
        self.assertEqual(last["prompt"], "hello")
        rec = self.access_for(px, "f1")
        self.assertEqual((rec["fallback"], rec["dispatch"]),
                         ("concurrent_prefill_failed", "concurrent"))
        self.assertEqual(self.metric(px, "pdproxy_decode_only_fallbacks_total",
                                     reason="concurrent_prefill_failed"), 1)

    def test_prefill_reset_without_fallback_is_a_clean_502(self):
        px, P, D, _ = self.fail_prefill_setup(lambda: Reset(), False)
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers=rid_headers("f2"))
        self.assertErrorJson(r, 502)
        self.check_decode_cancelled(D, 1)
        self.assertEqual(len(D.requests), 2)  # no decode-only retry

    def test_prefill_timeout_cancels_decode(self):
        px, P, D, _ = self.fail_prefill_setup(lambda: Hang(WAIT * 2), False,
                                              extra=["--prefill-timeout", "1"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers=rid_headers("f3"))
        self.assertErrorJson(r, 504)
        self.check_decode_cancelled(D, 1)

    def test_prefill_connect_refused_falls_back(self):
        """The prefill goes away after it was learned: connection refused on
        the concurrent leg, decode cancelled, then decode alone."""
        gate = Gate()
        p_base = prefill_handler(mode="push")
        d_base = decode_handler()

        def d(req):
            if is_push(req):
                gate.set()
                return Hang(WAIT * 2)
            return d_base(req)
        P = self.mock(p_base, name="P")
        D = self.mock(d, name="D")
        px = self.learned(P, D, extra=["--fallback-decode-only", "--prefill-retries", "0",
                                       "--health-interval", "0"])
        P.stop()
        n0 = len(D.requests)
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers=rid_headers("f4"))
        self.assertEqual(r.status, 200, r.body)
        rec = self.access_for(px, "f4")
        self.assertEqual(rec["fallback"], "concurrent_prefill_failed")
        # The cancelled concurrent leg's body may already sit in D's socket
        # and be read after the decode-alone request: compare as a set.
        plain = [q for q in D.requests[n0:] if "kv_transfer_params" not in q.json()]
        self.assertEqual(len(plain), 1, [q.json() for q in D.requests[n0:]])

    def test_prefill_4xx_reaches_the_client(self):
        body = b'{"error":{"message":"bad","type":"BadRequestError","code":400}}'
        px, P, D, _ = self.fail_prefill_setup(
            lambda: Respond(400, [("Content-Type", "application/json")], body), True)
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers=rid_headers("f5"))
        self.assertEqual(r.status, 400)
        self.assertEqual(r.body, body)
        self.check_decode_cancelled(D, 1)
        self.assertEqual(len(D.requests), 2)

    def test_failed_kv_load_drops_the_identity(self):
        """Decode fails to load the KV (vLLM's kv_load_failure_policy fail:
        500 InternalServerError): retried once without kv_transfer_params
        (--fallback-decode-only), and the prefill's identity is dropped, so
        the next request runs serial again and learns it anew."""
        err = (b'{"error":{"message":"Internal server error","type":"InternalServerError",'
               b'"param":null,"code":500}}')
        d_base = decode_handler()
        fails = {"n": 1}

        def d(req):
            if is_push(req) and fails["n"]:
                fails["n"] -= 1
                return Respond(500, [("Content-Type", "application/json")], err)
            return d_base(req)
        p_base, p_blind = prefill_handler(mode="push"), prefill_handler(kv={})

        def p(req):
            # The concurrent prefill's answer tells no identity here, so that
            # only the next serial answer can teach it again (a real one would
            # refresh it at once, in whichever order the legs end).
            if is_push(req):
                return p_blind(req)
            return p_base(req)
        P = self.mock(p, name="P")
        D = self.mock(d, name="D")
        px = self.learned(P, D, extra=["--fallback-decode-only"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers=rid_headers("kv1"))
        self.assertEqual(r.status, 200, r.body)
        rec = self.access_for(px, "kv1")
        self.assertEqual((rec["dispatch"], rec["fallback"]), ("concurrent", "kv_load_failed"))
        self.assertNotIn("kv_transfer_params", D.requests[2].json())
        for rid, want in (("kv2", "serial"), ("kv3", "concurrent")):
            r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                             headers=rid_headers(rid))
            self.assertEqual(r.status, 200, r.body)
            self.assertEqual(self.access_for(px, rid)["dispatch"], want)
        self.assertEqual(self.metric(px, "pdproxy_dispatch_total", mode="serial",
                                     reason="no_identity"), 2)

    def test_decode_idle_timeout_applies_to_the_decode_leg(self):
        """Prefill answers; decode never does: --decode-idle-timeout ends it
        (504), decode's leg closed."""
        p_base = prefill_handler(mode="push")
        d_base = decode_handler()

        def d(req):
            if is_push(req):
                return Hang(WAIT * 2)
            return d_base(req)
        P = self.mock(p_base, name="P")
        D = self.mock(d, name="D")
        px = self.learned(P, D, extra=["--decode-idle-timeout", "1"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers=rid_headers("i1"))
        self.assertErrorJson(r, 504)
        self.assertIsNotNone(D.requests[1].conn.wait_closed(WAIT))
        self.assertEqual(len(P.requests), 2)
        self.assertEqual(self.access_for(px, "i1")["dispatch"], "concurrent")

    def test_decode_fails_while_prefill_runs(self):
        gate = Gate()
        p_base = prefill_handler(mode="push")
        d_base = decode_handler()

        def p(req):
            if is_push(req):
                gate.set()
                return Hang(WAIT * 2)
            return p_base(req)

        def d(req):
            if is_push(req):
                gate.wait()
                return Reset()
            return d_base(req)
        P = self.mock(p, name="P")
        D = self.mock(d, name="D")
        px = self.learned(P, D)
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers=rid_headers("d1"))
        self.assertErrorJson(r, 502)
        self.assertIsNotNone(P.requests[1].conn.wait_closed(WAIT), "prefill leg not cancelled")
        self.assertTrue(P.requests[1].conn.closed_by_peer)

    def client_leaves(self, phase):
        """Both legs hang (phase "both") or prefill has answered and decode
        streams slowly (phase "stream"); the client leaves: every leg still
        open is closed by pdproxy."""
        gate = Gate()
        p_base = prefill_handler(mode="push")
        d_base = decode_handler()
        p_sent = []  # bytes P had sent on the push leg's connection before answering it

        def p(req):
            if is_push(req):
                p_sent.append(req.conn.bytes_sent)
                gate.set()
                return Hang(WAIT * 2) if phase == "both" else p_base(req)
            return p_base(req)

        def d(req):
            if is_push(req):
                if phase in ("both", "decode_wait"):
                    return Hang(WAIT * 2)
                return Stream(200, [("Content-Type", "text/event-stream")],
                              [(0.0, sse_events(["a"], done=False)[0])] +
                              [(0.2, c) for c in sse_events(["b"] * 40)])
            return d_base(req)
        P = self.mock(p, name="P")
        D = self.mock(d, name="D")
        px = self.learned(P, D)
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body(stream=True),
                  headers=[("X-Request-Id", "gone-" + phase)])
        if phase == "stream":
            c.read_response(head_only=True)
        self.assertTrue(gate.wait())
        self.assertEqual(len(D.wait_requests(2, timeout=WAIT)), 2, "no decode leg")
        if phase == "decode_wait":
            # The client leaves once pdproxy has read prefill's answer.
            pconn = P.requests[1].conn
            self.assertTrue(wait_until(lambda: pconn.bytes_sent > p_sent[0] and
                                       read_by_peer(pconn.local_port, pconn.peer_port), WAIT),
                            "pdproxy did not read prefill's answer")
        c.close()
        self.assertIsNotNone(D.requests[1].conn.wait_closed(WAIT), "decode leg left open")
        if phase == "both":
            self.assertIsNotNone(P.requests[1].conn.wait_closed(WAIT), "prefill leg left open")
        rec = self.access_for(px, "gone-" + phase)
        self.assertEqual(rec["status"], "499")
        self.assertEqual(rec["dispatch"], "concurrent")

    def test_client_leaves_while_both_legs_run(self):
        self.client_leaves("both")

    def test_client_leaves_while_decode_streams(self):
        self.client_leaves("stream")

    def test_client_leaves_after_prefill_answered(self):
        """Prefill has answered; decode still waits (for KV): the client
        leaves, decode's leg is closed."""
        self.client_leaves("decode_wait")

    @unittest.skipIf(MOCK_TLS, "the file names http:// backends")
    def test_dispatch_reloads(self):
        """--dispatch in the file, changed and reloaded (SIGHUP): the next
        requests are sent the new way."""
        P = self.mock(prefill_handler(mode="push"), name="P")
        D = self.mock(decode_handler(), name="D")
        d = tmpdir(self)
        path = os.path.join(d, "pd.yaml")
        base = "prefill: [%s]\ndecode: [%s]\n" % (json.dumps("http://127.0.0.1:%d" % P.port),
                                                  json.dumps("http://127.0.0.1:%d" % D.port))
        write_yaml(path, base + "dispatch: serial\n")
        px = self.start_proxy(args=["--config", path])
        for rid in ("r0", "r1"):
            self.assertEqual(http_request(px.port, "POST", "/v1/completions", completion_body(),
                                          headers=rid_headers(rid)).status, 200)
            self.assertEqual(self.access_for(px, rid)["dispatch"], "serial")
        write_yaml(path, base + "dispatch: concurrent\n")
        sighup(px)
        wait_generation(self, px, 2)
        # The serial answers before the reload did not teach (serial mode
        # does not keep identities): one more serial, then concurrent.
        for rid, want in (("r2", "serial"), ("r3", "concurrent")):
            self.assertEqual(http_request(px.port, "POST", "/v1/completions", completion_body(),
                                          headers=rid_headers(rid)).status, 200)
            self.assertEqual(self.access_for(px, rid)["dispatch"], want)
        self.assertEqual(kvp_of(P.requests[3])["transfer_mode"], "push")

    @unittest.skipIf(MOCK_TLS, "the file names http:// backends")
    def test_pool_dispatch_in_config_file(self):
        """dispatch: per pool in the file; the global flag stays serial."""
        P1 = self.mock(prefill_handler(mode="push"), name="P1")
        D1 = self.mock(decode_handler(), name="D1")
        P2 = self.mock(prefill_handler(mode="push"), name="P2")
        D2 = self.mock(decode_handler(), name="D2")
        d = tmpdir(self)
        path = os.path.join(d, "pools.yaml")
        text = pools_yaml([("a", ["ma"], [P1], [D1]), ("b", ["mb"], [P2], [D2])])
        text = text.replace('  - name: "b"\n', '  - name: "b"\n    dispatch: concurrent\n')
        with open(path, "w") as f:
            f.write(text)
        px = self.start_proxy(args=["--config", path])
        for i in range(2):
            for m in ("ma", "mb"):
                r = http_request(px.port, "POST", "/v1/completions", completion_body(model=m),
                                 headers=rid_headers("%s%d" % (m, i)))
                self.assertEqual(r.status, 200, r.body)
        self.assertEqual(self.access_for(px, "mb1")["dispatch"], "concurrent")
        self.assertEqual(len(P2.requests), 2, px.stderr()[-3000:])
        self.assertNotIn("transfer_mode", kvp_of(P1.requests[1]))
        self.assertEqual(kvp_of(P2.requests[1])["transfer_mode"], "push")
        self.assertEqual(self.access_for(px, "ma1")["dispatch"], "serial")
        self.assertEqual(self.access_for(px, "mb1")["dispatch"], "concurrent")
        self.assertEqual(self.metric(px, "pdproxy_dispatch_total", mode="serial",
                                     reason="configured"), 2)
        with open(path, "w") as f:
            f.write(text.replace("dispatch: concurrent", "dispatch: sideways"))
        out = subprocess.run([PDPROXY, "--config", path, "--print-config"], capture_output=True,
                             text=True, timeout=30)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("dispatch", out.stderr)
        self.assertIn("sideways", out.stderr)


PROMPT = prose(3000, seed=11)


class ConcurrentSimTest(PdCase):
    """Real KV between two engine-sims in push mode."""

    def pair(self, p_extra=(), d_extra=(), px_extra=(), d_killed=False):
        P = self.engine("prefill", PUSH + list(p_extra))
        if d_killed:  # killed by the test: not required to exit cleanly
            D = start_engine_sim("decode", PUSH + list(d_extra))
            self.addCleanup(D.kill)
        else:
            D = self.engine("decode", PUSH + list(d_extra))
        px = self.start_proxy([P.port], [D.port], extra=CONC + list(px_extra))
        return P, D, px

    def published_left(self, P):
        m = lambda n: self.engine_metric(P.port, n) or 0
        return (m("engine_sim_kv_blocks_published_total")
                - m("engine_sim_kv_blocks_released_by_consumer_total")
                - m("engine_sim_kv_blocks_expired_total"))

    def assert_none_stranded(self, P):
        left = wait_value(lambda: self.published_left(P), lambda n: n == 0, 10.0, 0.05)
        self.assertEqual(left, 0)

    def ask(self, px, path, body, rid, stream=False):
        st, hd, raw = post_json(px.port, path, body, stream=stream, headers=rid_headers(rid))
        self.assertEqual(st, 200, raw)
        return raw

    def test_answers_as_serial_with_real_kv(self):
        P, D, px = self.pair()
        comp = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8}
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 8}
        first = self.ask(px, "/v1/completions", comp, "s0")  # serial: learns P
        self.assertEqual(self.access_for(px, "s0")["dispatch"], "serial")
        post_json(D.port, "/reset_prefix_cache", {})
        again = self.ask(px, "/v1/completions", comp, "s1")
        self.assertEqual(json.loads(again)["choices"], json.loads(first)["choices"])
        post_json(D.port, "/reset_prefix_cache", {})
        self.ask(px, "/v1/chat/completions", dict(chat, stream=True), "s2", stream=True)
        post_json(D.port, "/reset_prefix_cache", {})
        self.ask(px, "/v1/chat/completions", chat, "s3")
        for rid in ("s1", "s2", "s3"):
            rec = self.access_for(px, rid)
            self.assertEqual(rec["dispatch"], "concurrent", rec)
            self.assertGreaterEqual(float(rec["kv_wait_ms"]), 0.0)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetch_failures_total"), 0,
                         D.log()[-3000:] + P.log()[-3000:])
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetches_total"), 4)
        self.assertEqual(self.metric(px, "pdproxy_dispatch_total", mode="concurrent",
                                     reason="identity_cached"), 3)
        self.assertEqual(self.metric(px, "pdproxy_decode_kv_wait_seconds_count"), 4)
        self.assert_none_stranded(P)
        # Both legs of every request carried the same minted transfer_id,
        # which the engines read (vLLM's push connector pairs them by it).
        for e in (P, D):
            self.assertEqual(self.engine_metric(e.port, "engine_sim_kv_transfer_id_missing_total"),
                             0)
        tids = lambda e, role: re.findall(
            r"role=%s transfer_mode=push transfer_id=(xfer-[0-9a-f]{32})" % role, e.log())
        self.assertEqual(len(set(tids(P, "prefill"))), 4)
        self.assertEqual(sorted(tids(P, "prefill")), sorted(tids(D, "decode")))

    def test_vllm_key_set_reaches_decode_verbatim(self):
        """engine-sim's prefill answers with the keys vLLM's NIXL schedulers
        write today (remote_block_ids per KV-cache group, transfer_mode,
        pp_size, dcp_size, remote_num_tokens, remote_blocks_expiry_time);
        decode gets them byte for byte, plus the transfer_id prefill got."""
        P = self.engine("prefill")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([P.port], [D])
        self.ask(px, "/v1/completions", {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4},
                 "k0")
        kvp = kvp_of(D.requests[0])
        ids = kvp["remote_block_ids"]
        self.assertEqual(len(ids), 1)  # one KV-cache group
        self.assertTrue(ids[0] and all(isinstance(b, int) for b in ids[0]), ids)
        self.assertTrue(16 * (len(ids[0]) - 1) < kvp["remote_num_tokens"] <= 16 * len(ids[0]))
        for k, v in (("transfer_mode", "pull"), ("pp_size", 1), ("dcp_size", 1),
                     ("remote_blocks_expiry_time", None), ("tp_size", 1)):
            self.assertIn(k, kvp)
            self.assertEqual(kvp[k], v, k)
        self.assertIn(b'"remote_block_ids":[[%d,' % ids[0][0], D.requests[0].body)
        self.assertRegex(kvp["transfer_id"], r"^xfer-[0-9a-f]{32}$")
        self.assertIn("role=prefill transfer_mode=pull transfer_id=" + kvp["transfer_id"],
                      P.log())

    def test_pull_sims_are_sent_serial(self):
        """engine-sims as vLLM's NixlConnector (pull, their default) behind
        --dispatch concurrent: every request after the first is sent
        serial (reason prefill_pulls), so decode never gets
        do_remote_prefill without remote_block_ids (which kills vLLM's
        engine core; engine-sim answers 500 and counts it)."""
        P, D = self.engine("prefill"), self.engine("decode")
        px = self.start_proxy([P.port], [D.port], extra=CONC)
        for i in range(4):
            self.ask(px, "/v1/completions",
                     {"model": "sim-model", "prompt": prose(3000, seed=60 + i), "max_tokens": 4},
                     "pull%d" % i)
            self.assertEqual(self.access_for(px, "pull%d" % i)["dispatch"], "serial")
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_params_without_blocks_total"),
                         0)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetches_total"), 4)
        self.assertEqual(self.metric(px, "pdproxy_dispatch_total", mode="serial",
                                     reason="prefill_pulls"), 3)
        self.assert_none_stranded(P)

    def test_prefill_restarted_in_pull_mode(self):
        """A prefill learned pushing restarts as a pull engine (its decode
        with it): the failed health check makes pdproxy forget what it
        learned, so not even the first request after the restart is sent
        both legs at once; its answer (transfer_mode pull) keeps the rest
        serial."""
        P, D = start_engine_sim("prefill", PUSH), start_engine_sim("decode", PUSH)
        self.addCleanup(P.kill)
        self.addCleanup(D.kill)
        px = self.start_proxy([P.port], [D.port], extra=CONC + [
            "--health-interval", "0.1", "--unhealthy-after", "1", "--healthy-after", "1"])
        comp = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
        self.ask(px, "/v1/completions", comp, "r0")
        self.ask(px, "/v1/completions", dict(comp, prompt=prose(3000, seed=71)), "r1")
        self.assertEqual(self.access_for(px, "r1")["dispatch"], "concurrent")
        self.assertEqual(P.stop(), 0)
        self.assertEqual(D.stop(), 0)
        up = lambda role: self.metric(px, "pdproxy_backend_up", role=role)
        self.assertTrue(wait_until(lambda: up("prefill") == 0, 10, 0.05), "P not seen down")
        P2 = start_engine_sim("prefill", port=P.port)  # pull: the default
        self.addCleanup(P2.kill)
        D2 = start_engine_sim("decode", port=D.port)
        self.addCleanup(D2.kill)
        self.assertTrue(wait_until(lambda: up("prefill") == 1 and up("decode") == 1, 10, 0.05))
        for i in range(4):
            self.ask(px, "/v1/completions", dict(comp, prompt=prose(3000, seed=80 + i)),
                     "r%d" % (i + 2))
            self.assertEqual(self.access_for(px, "r%d" % (i + 2))["dispatch"], "serial")
        self.assertEqual(self.engine_metric(D2.port, "engine_sim_kv_params_without_blocks_total"),
                         0, D2.log()[-3000:])
        self.assertEqual(self.engine_metric(D2.port, "engine_sim_kv_fetches_total"), 4)
        self.assertEqual(self.metric(px, "pdproxy_dispatch_total", mode="serial",
                                     reason="no_identity"), 2)
        self.assertEqual(self.metric(px, "pdproxy_dispatch_total", mode="serial",
                                     reason="prefill_pulls"), 3)
        self.assert_none_stranded(P2)

    def test_queued_decode_renews_the_prefill_lease(self):
        """Decode renews the lease of prefill's publication by the
        remote_request_id its params name, as vLLM's decode heartbeats
        (base_scheduler.on_new_request); in concurrent dispatch that is
        pdproxy's minted id, under which the push prefill published. A
        decode request queued behind a full KV pool for longer than the
        lease (0.6 s here) still finds the KV."""
        lease = ["--kv-lease-ms", "600"]
        P, D, px = self.pair(p_extra=lease, d_extra=lease + ["--num-blocks", "40",
                                                             "--itl-ms", "40"])
        self.ask(px, "/v1/completions", {"model": "sim-model", "prompt": prose(200, seed=90),
                                         "max_tokens": 2}, "l0")  # learns P
        post_json(D.port, "/reset_prefix_cache", {})
        out = {}

        def run(rid, seed, n):
            out[rid] = post_json(px.port, "/v1/completions",
                                 {"model": "sim-model", "prompt": prose(3000, seed=seed),
                                  "max_tokens": n}, headers=rid_headers(rid))
        first = threading.Thread(target=run, args=("l1", 91, 50))  # holds 30 of D's 40 blocks 2 s
        first.start()
        self.assertTrue(wait_until(
            lambda: self.engine_metric(D.port, "engine_sim_kv_fetches_total") == 2, 10, 0.02))
        run("l2", 92, 4)  # waits at D for blocks while P's lease runs
        first.join(30)
        self.assertFalse(first.is_alive())
        for rid in ("l1", "l2"):
            self.assertEqual(out[rid][0], 200, out[rid][2])
            self.assertEqual(self.access_for(px, rid)["dispatch"], "concurrent")
        self.assertGreater(self.engine_metric(D.port, "engine_sim_kv_lease_renewals_total"), 0)
        self.assertEqual(self.engine_metric(P.port, "engine_sim_kv_blocks_expired_total"), 0,
                         P.log()[-3000:])
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetch_failures_total"), 0)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetches_total"), 3)
        # l2 waited at decode for blocks past the lease, then loaded the KV.
        rec = self.access_for(px, "l2")
        self.assertGreater(float(rec["ttfb_ms"]), 600.0)
        self.assertIn("kv_wait_ms", rec)
        self.assert_none_stranded(P)

    def test_slow_prefill_decode_registers_first(self):
        """Prefill takes ~0.3 s to compute: decode's held fetch is registered
        long before it publishes, and waits for it (X-KV-Wait-Ms)."""
        P, D, px = self.pair(p_extra=["--prefill-us-per-token", "400"])
        comp = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
        self.ask(px, "/v1/completions", comp, "w0")
        post_json(D.port, "/reset_prefix_cache", {})
        post_json(P.port, "/reset_prefix_cache", {})
        self.ask(px, "/v1/completions", dict(comp, prompt=prose(3000, seed=21)), "w1")
        rec = self.access_for(px, "w1")
        self.assertEqual(rec["dispatch"], "concurrent")
        self.assertGreater(float(rec["kv_wait_ms"]), 50.0)
        self.assertEqual(self.engine_metric(D.port, "engine_sim_kv_fetch_failures_total"), 0)
        self.assert_none_stranded(P)

    def test_client_leaves_during_prefill_nothing_stranded(self):
        P, D, px = self.pair(p_extra=["--prefill-us-per-token", "400"])
        comp = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
        self.ask(px, "/v1/completions", comp, "g0")
        for i in range(3):
            base = self.engine_metric(P.port, "engine_sim_requests_total")
            c = RawClient(px.port)
            c.request("POST", "/v1/completions", dict(comp, prompt=prose(3000, seed=30 + i)),
                      headers=[("X-Request-Id", "gone%d" % i)])
            # Once prefill computes it, and then 0, 50 or 100 ms into its
            # ~0.2 s of prefill (pacing: three points of it), whatever the
            # previous one left the engine computing (access lines come in
            # batches, so the wait below may give it time to finish).
            self.assertTrue(wait_until(lambda: self.engine_metric(
                P.port, "engine_sim_requests_total") > base, 5.0), "prefill never got gone%d" % i)
            time.sleep(0.05 * i)
            c.close()
            rec = self.access_for(px, "gone%d" % i)
            self.assertEqual(rec["status"], "499")
        # The engines stay usable and nothing is left published.
        self.ask(px, "/v1/completions", dict(comp, prompt=prose(3000, seed=39)), "g9")
        self.assert_none_stranded(P)

    def test_decode_killed_prefill_cancelled_nothing_stranded(self):
        P, D, px = self.pair(p_extra=["--prefill-us-per-token", "400"], d_killed=True)
        comp = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
        self.ask(px, "/v1/completions", comp, "k0")
        out = {}

        def run():
            out["r"] = http_request(px.port, "POST", "/v1/completions",
                                    dict(comp, prompt=prose(3000, seed=41)), headers=rid_headers("k1"))
        base = [self.engine_metric(e.port, "engine_sim_requests_total") for e in (P, D)]
        t = threading.Thread(target=run)
        t.start()
        # Decode is killed once both engines have the request, while
        # prefill computes it (400 us a token).
        self.assertTrue(wait_until(lambda: all(
            self.engine_metric(e.port, "engine_sim_requests_total") > b
            for e, b in zip((P, D), base)), 5.0), "the engines never got k1")
        D.kill()
        t.join(30)
        self.assertFalse(t.is_alive())
        self.assertErrorJson(out["r"], 502)
        self.assert_none_stranded(P)


if __name__ == "__main__":
    main()
