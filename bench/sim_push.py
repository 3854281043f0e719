#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Serial against push-mode P/D legs on an engine-sim pair (no proxy): the
time until decode's answer (max_tokens 1: time to first token) when the
caller sends prefill first and decode with prefill's kv_transfer_params
(serial, vLLM's pull mode), against both at once with a caller-minted id and
token, decode's fetch held at prefill until it publishes (push mode, what
`--dispatch concurrent` will send). Prints p50/p90 side by side.

    bench/sim_push.py [--requests 40] [--tokens 2000] [--us-per-token 50]
                      [--bin build/bin]

Python 3 standard library only; everything on 127.0.0.1; bounded in count
and time (each request 60 s)."""

import argparse
import json
import os
import secrets
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "integration"))
from pdharness.client import post_json
from pdharness.prom import prom

WORDS = "the quick brown fox jumps over a lazy dog while wizards examine manuscripts".split()


def prompt(i, ntok):
    return "req %d " % i + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(ntok))


def serial(P, D, text):
    body = {"model": "sim-model", "prompt": text, "max_tokens": 1}
    t0 = time.monotonic()
    st, _, raw = post_json(P, "/v1/completions", dict(body, kv_transfer_params={
        "do_remote_decode": True}))
    assert st == 200, raw
    kvp = json.loads(raw)["kv_transfer_params"]
    st, _, raw = post_json(D, "/v1/completions", dict(body, kv_transfer_params=kvp))
    assert st == 200, raw
    return time.monotonic() - t0, kvp


def push(P, D, text, ident):
    return push_legs(P, D, text, ident)[0]


def push_legs(P, D, text, ident, prefix="push-"):
    """Both legs at once; (seconds until decode answered, decode's headers)."""
    rid, tok = prefix + secrets.token_hex(8), secrets.token_hex(16)
    body = {"model": "sim-model", "prompt": text, "max_tokens": 1}
    pk = {"do_remote_decode": True, "remote_request_id": rid, "remote_kv_token": tok,
          "transfer_mode": "push"}
    dk = dict(ident, do_remote_prefill=True, remote_request_id=rid, remote_kv_token=tok,
              transfer_mode="push")
    res = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: res.update(p=post_json(P, "/v1/completions",
                                                               dict(body, kv_transfer_params=pk))))
    t.start()
    st, hd, raw = post_json(D, "/v1/completions", dict(body, kv_transfer_params=dk))
    dt = time.monotonic() - t0
    t.join(60)
    assert st == 200 and res["p"][0] == 200, raw
    return dt, hd


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--us-per-token", type=int, default=50)
    ap.add_argument("--bin", default="build/bin")
    a = ap.parse_args()
    os.environ.setdefault("PX_BIN_DIR", os.path.abspath(a.bin))
    from pdharness.procs import start_proc
    sim = os.path.join(os.path.abspath(a.bin), "engine-sim")

    def engine(role):
        return start_proc("engine-sim-" + role, lambda port: [
            sim, "--role", role, "--port", str(port), "--num-blocks", "8192",
            "--layers", "4", "--block-bytes", "16384",
            "--prefill-us-per-token", str(a.us_per_token), "--log-level", "warn",
            "--kv-transfer-mode", "push"], "/health")
    P, D = engine("prefill"), engine("decode")
    try:
        _, kvp = serial(P.port, D.port, prompt(-1, 50))
        ident = {k: kvp[k] for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}
        ts, tp = [], []
        for i in range(a.requests):  # alternated, so drift hits both alike
            ts.append(serial(P.port, D.port, prompt(2 * i, a.tokens))[0])
            tp.append(push(P.port, D.port, prompt(2 * i + 1, a.tokens), ident))
        fetched = {n: v for n, _, v in prom(D.port) if n.startswith("engine_sim_kv_")}
        print("%d requests of ~%d tokens, --prefill-us-per-token %d" % (a.requests, a.tokens,
                                                                        a.us_per_token))
        print("%-10s %10s %10s" % ("dispatch", "p50 ms", "p90 ms"))
        for name, xs in (("serial", ts), ("push", tp)):
            print("%-10s %10.2f %10.2f" % (name, 1e3 * pct(xs, 0.5), 1e3 * pct(xs, 0.9)))
        print("decode: fetches %d, failures %d, bytes %d" % (
            fetched.get("engine_sim_kv_fetches_total", 0),
            fetched.get("engine_sim_kv_fetch_failures_total", 0),
            fetched.get("engine_sim_kv_bytes_fetched_total", 0)))
    finally:
        for p in (P, D):
            p.stop()


if __name__ == "__main__":
    main()
