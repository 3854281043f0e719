#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Decode's KV wait for a long prompt on engine-sim, layer-wise publishing
off against on, side by side in one run.  Two prefills with the same
per-layer compute time (--layer-compute-us): one publishes after its last
layer, the other before its first and marks each layer ready as it computes
it (--kv-layerwise 1); one decode.  Each request goes to a prefill and to
decode at once (push mode, as `--dispatch concurrent` sends it): decode's
fetch waits at prefill, so its KV wait (X-KV-Wait-Ms, from the request's
arrival at decode to every block present) holds prefill's forward pass in
both cases; what layer-wise removes is the transfer after the last layer.
Requests alternate between the two prefills, so drift hits both alike.
The bytes move pushed over tcp (KVC_PROTO=push, UCX_TLS=tcp): what a
transfer between two hosts does; on one host the connector would read the
pool one-sided, which waits for the whole publication.

    bench/sim_layers.py [--requests 9] [--tokens 4096] [--layers 32]
                        [--layer-us 4000] [--block-bytes 8192] [--bin build/bin]

Prints the medians (and p90) of the KV wait and of the wait past the
forward pass (KV wait - layers x layer-us), and the ratio.  Python 3
standard library only; everything on 127.0.0.1; bounded in count and time
(each request 60 s)."""

import argparse
import os
import secrets
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "integration"))
from pdharness.client import post_json
from pdharness.prom import prom
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sim_push import pct, prompt, push_legs  # noqa: E402

def ident_of(P, D):
    """The prefill's kv_transfer_params identity, from one serial request."""
    body = {"model": "sim-model", "prompt": prompt(-1, 20), "max_tokens": 1}
    st, _, raw = post_json(P, "/v1/completions", dict(body, kv_transfer_params={
        "do_remote_decode": True, "remote_request_id": "warm-" + secrets.token_hex(6),
        "remote_kv_token": secrets.token_hex(16), "transfer_mode": "push"}))
    assert st == 200, raw
    import json
    kvp = json.loads(raw)["kv_transfer_params"]
    return {k: kvp[k] for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}


def push(P, D, text, ident):
    """Decode's KV wait (ms) for one request sent to P and D at once."""
    hd = push_legs(P, D, text, ident, prefix="lw-")[1]
    wait = {k.lower(): v for k, v in hd.items()}.get("x-kv-wait-ms")
    assert wait is not None, hd
    return float(wait)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=9, help="per mode")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--layer-us", type=int, default=4000)
    ap.add_argument("--block-bytes", type=int, default=8192)
    ap.add_argument("--bin", default="build/bin")
    a = ap.parse_args()
    os.environ.setdefault("PX_BIN_DIR", os.path.abspath(a.bin))
    from pdharness.procs import start_proc
    sim = os.path.join(os.path.abspath(a.bin), "engine-sim")
    env = dict(os.environ, KVC_PROTO="push", UCX_TLS="tcp,self", UCX_WARN_UNUSED_ENV_VARS="n")

    def engine(role, layerwise=0):
        return start_proc("engine-sim-%s-%d" % (role, layerwise), lambda port: [
            sim, "--role", role, "--port", str(port), "--num-blocks", "4096",
            "--layers", str(a.layers), "--block-bytes", str(a.block_bytes),
            "--layer-compute-us", str(a.layer_us), "--kv-layerwise", str(layerwise),
            "--log-level", "warn", "--kv-transfer-mode", "push"], "/health", env=env)
    procs = []
    try:
        procs += [engine("prefill", 0), engine("prefill", 1), engine("decode")]
        Poff, Pon, D = (p.port for p in procs)
        ids = {Poff: ident_of(Poff, D), Pon: ident_of(Pon, D)}
        waits = {Poff: [], Pon: []}
        for i in range(a.requests):
            for P in ((Poff, Pon) if i % 2 == 0 else (Pon, Poff)):
                waits[P].append(push(P, D, prompt(2 * i + (P == Pon), a.tokens), ids[P]))
        m = {n: v for n, _, v in prom(D) if n.startswith("engine_sim_kv_")}
        print("kv waits ms, off: %s" % " ".join("%.0f" % w for w in waits[Poff]))
        print("kv waits ms, on:  %s" % " ".join("%.0f" % w for w in waits[Pon]))
        fwd = a.layers * a.layer_us / 1e3
        print("%d requests per mode of ~%d tokens, %d layers x %d us (forward pass %.1f ms), "
              "%d bytes per block per region" % (a.requests, a.tokens, a.layers, a.layer_us, fwd,
                                                 a.block_bytes))
        print("%-12s %14s %14s %18s" % ("layer-wise", "kv wait p50 ms", "kv wait p90 ms",
                                         "past forward p50 ms"))
        med = {}
        for name, P in (("off", Poff), ("on", Pon)):
            med[name] = statistics.median(waits[P])
            print("%-12s %14.2f %14.2f %18.2f" % (name, med[name], pct(waits[P], 0.9),
                                                  med[name] - fwd))
        past_off, past_on = med["off"] - fwd, med["on"] - fwd
        print("kv_wait_ratio_on_off=%.3f past_forward_ratio_on_off=%.3f" % (
            med["on"] / med["off"], past_on / past_off if past_off > 0 else float("nan")))
        print("decode: fetches %d, failures %d, bytes %d" % (
            m.get("engine_sim_kv_fetches_total", 0), m.get("engine_sim_kv_fetch_failures_total", 0),
            m.get("engine_sim_kv_bytes_fetched_total", 0)))
    finally:
        for p in procs:
            p.stop()


if __name__ == "__main__":
    main()
