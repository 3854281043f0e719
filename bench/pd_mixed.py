#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Mixed workload through pdproxy and an engine-sim P/D pair on loopback:
mean time to first token and prefill load with --disagg-min-tokens 0
(always disaggregate) against a tuned threshold.

Half the prompts are ~100 tokens, half ~4k tokens; of the long ones half
share one of a few documents (a shared prefix) and differ in the question at
the end. engine-sim computes prompts one at a time per engine at
--prefill-us-per-token (cached prefixes and received KV skipped), so where a
prompt is prefilled shows in time to first token.

    bench/pd_mixed.py [--requests 120] [--concurrency 8] [--tuned 512]
                      [--us-per-token 50] [--bin build/bin]
                      [--endpoints chat,responses,generate]

--endpoints runs the same workload through each endpoint pdproxy
disaggregates (streamed chat completions, /v1/responses, token-in
/inference/v1/generate with one token id per word) and prints the rows side
by side.

--dispatch serial,concurrent runs the workload always disaggregated
(--disagg-min-tokens 0) once per --dispatch mode, engine-sims in push mode
where concurrent, and prints TTFT p50/p90/mean, decode's wait for KV
(pdproxy_decode_kv_wait_seconds, from decode's X-KV-Wait-Ms) and decode's
queueing time side by side instead of the threshold comparison: the mean per
request of decode engine-sim's waits for free KV blocks and behind the
computations queued before its own (engine_sim_queue_seconds_total over
engine_sim_queue_entries_total, per queue).  With both modes it checks the
goal of issue 25: concurrent mean TTFT <= serial mean TTFT - decode's mean
queueing time under serial.  --repeat N runs the modes alternately N times
(serial, concurrent, serial, ...) and adds a table of the medians over the
runs, on which the goal is checked again.

A decode engine-sim on its defaults never queues: it generates every request
at once and its pool never runs out.  --decode-busy loads it as a real decode
engine is loaded: outputs of 64 tokens 20 ms apart (--max-tokens 64, decode's
--itl-ms 20) and --max-num-seqs 4, vLLM's cap of sequences generating at once,
so a request whose KV has arrived waits for a slot.  --decode-args passes
more engine-sim flags to decode (after the others: they win), e.g.
"--num-blocks 600" to make it wait for free KV blocks.

Python 3 standard library only; everything on 127.0.0.1; bounded in count
and time (each request 60 s, the whole run --deadline seconds)."""

import argparse
import http.client
import json
import os
import random
import re
import shlex
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "integration"))
from pdharness.net import HOST
from pdharness.procs import start_proc
from pdharness.prom import prom

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly examine "
         "ancient manuscripts about distributed inference caching and scheduling engineers "
         "measure latency carefully before they decide").split()
BYTES_PER_TOKEN = 6.3  # engine-sim's tokenizer on this prose (tests/integration/test_pd_disagg.py)


def text(ntokens, rng):
    return " ".join(rng.choice(WORDS) for _ in range(ntokens))


def workload(n, seed):
    rng = random.Random(seed)
    docs = [text(3900, random.Random(seed * 100 + i)) for i in range(3)]
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append(("short", text(95, rng) + " ?"))
        elif i % 4 == 1:
            out.append(("shared", rng.choice(docs) + " question " + text(60, rng) + " ?"))
        else:
            out.append(("long", text(4000, rng) + " ?"))
    rng.shuffle(out)
    return out


def metrics(port):
    """{name: value} for samples without labels, {name{labels}: value} for
    the others (the sum of equal keys)."""
    out = {}
    for name, labels, v in prom(port):
        if labels:
            name += "{%s}" % ",".join('%s="%s"' % kv for kv in labels.items())
        out[name] = out.get(name, 0) + v
    return out


# Per endpoint: path, body of a streamed request, and the bytes that show
# the first generated token in the stream.
MAX_TOKENS = [16]  # --max-tokens


def chat_req(prompt):
    return ("/v1/chat/completions",
            {"model": "sim-model", "max_tokens": MAX_TOKENS[0], "stream": True,
             "messages": [{"role": "user", "content": prompt}]})


def responses_req(prompt):
    return ("/v1/responses", {"model": "sim-model", "max_output_tokens": MAX_TOKENS[0],
                              "stream": True,
                              "input": prompt})


def generate_req(prompt):
    ids = [1 + (sum(map(ord, w)) * 131 + i) % 31999 for i, w in enumerate(prompt.split())]
    return ("/inference/v1/generate", {"model": "sim-model", "stream": True, "token_ids": ids,
                                       "sampling_params": {"max_tokens": MAX_TOKENS[0]}})


ENDPOINTS = {"chat": (chat_req, lambda b: b'"content":"' in b.replace(b'"content":""', b"")),
             "responses": (responses_req, lambda b: b'"delta":' in b),
             "generate": (generate_req, lambda b: b'"token_ids":[' in b)}


def one(port, prompt, timeout, endpoint="chat"):
    """Streams one request; returns time to the first generated token."""
    make, first = ENDPOINTS[endpoint]
    path, doc = make(prompt)
    body = json.dumps(doc)
    t0 = time.monotonic()
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    c.request("POST", path, body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError("status %d: %r" % (r.status, r.read()[:200]))
    ttft = None
    buf = b""
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(4096)
        if not chunk:
            break
        buf += chunk
        if ttft is None and first(buf):
            ttft = time.monotonic() - t0
    c.close()
    done = b"response.completed" if endpoint == "responses" else b"[DONE]"
    if done not in buf:
        raise RuntimeError("stream without its last event")
    return ttft if ttft is not None else time.monotonic() - t0


def run(args, threshold, reqs, endpoint="chat", dispatch="serial"):
    sim = os.path.join(args.bin, "engine-sim")
    common = ["--num-blocks", "16384", "--block-bytes", "1024", "--layers", "2",
              "--prefill-us-per-token", str(args.us_per_token), "--itl-ms", "5",
              "--log-level", "warn"]
    if dispatch == "concurrent":  # only a push prefill is sent both legs at once
        common += ["--kv-transfer-mode", "push"]
    procs = []
    try:
        pp = start_proc("prefill", lambda port: [sim, "--role", "prefill", "--port", str(port)]
                        + common, "/health", track=procs.append).port
        dp = start_proc("decode", lambda port: [sim, "--role", "decode", "--port", str(port)]
                        + common + args.decode_sim_args, "/health", track=procs.append).port
        xp = start_proc("pdproxy", lambda port: [
            os.path.join(args.bin, "pdproxy"), "--port", str(port), "--threads", "1",
            "--log-level", "warn", "--access-log=false", "--prefiller-hosts", HOST, "--prefiller-ports", str(pp),
            "--decoder-hosts", HOST, "--decoder-ports", str(dp),
            "--disagg-min-tokens", str(threshold),
            "--disagg-bytes-per-token", str(BYTES_PER_TOKEN), "--dispatch", dispatch],
            "/healthcheck",
            track=procs.append).port
        results, errors = [], []
        lock = threading.Lock()
        it = iter(reqs)
        deadline = time.monotonic() + args.deadline

        def worker():
            while time.monotonic() < deadline:
                with lock:
                    nxt = next(it, None)
                if nxt is None:
                    return
                kind, prompt = nxt
                try:
                    t = one(xp, prompt, 60, endpoint)
                    with lock:
                        results.append((kind, t))
                except Exception as e:  # noqa: BLE001 (counted and reported)
                    with lock:
                        errors.append(str(e))

        t0 = time.monotonic()
        ths = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = time.monotonic() - t0
        pm, dm, xm = metrics(pp), metrics(dp), metrics(xp)
        dec = {k: v for k, v in xm.items()
               if (k.startswith("pdproxy_disagg_decisions_total")
                   or k.startswith("pdproxy_dispatch_total")
                   or k.startswith("pdproxy_decode_kv_wait_seconds_")) and v}
        return results, errors, wall, pm, dm, dec
    finally:
        for p in reversed(procs):
            p.stop()
            os.unlink(p.log_path)


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def decode_queue(dm):
    """Decode's mean queueing per request, seconds: (for free KV blocks,
    behind earlier computations, for a generation slot, all).  Each decode
    request is admitted once, computes once (its last prompt token, or its
    prompt when it recomputes) and generates once, so the means add up to
    the wait of one request."""
    out = []
    for q in ("kv_blocks", "compute", "seqs"):
        n = dm.get('engine_sim_queue_entries_total{queue="%s"}' % q, 0)
        out.append(dm.get('engine_sim_queue_seconds_total{queue="%s"}' % q, 0) / n
                   if n else 0.0)
    return out[0], out[1], out[2], sum(out)


HEAD = ("| --dispatch | TTFT p50 ms | TTFT p90 ms | mean TTFT ms | decode KV wait mean ms | "
        "engine-sim fetch mean ms | decode queue mean ms (KV blocks + compute + slot) | "
        "sent concurrent | wall s | ok | errors |\n|---|---|---|---|---|---|---|---|---|---|---|")


def print_row(mode, p50, p90, m, w, f, qs, conc, wall, ok, nerr):
    qb, qc, qsl, q = qs
    print("| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f (%.1f + %.1f + %.1f) | %d | %.1f | %d | "
          "%d |" % (mode, p50 * 1e3, p90 * 1e3, m * 1e3, w * 1e3, f * 1e3, q * 1e3, qb * 1e3,
                    qc * 1e3, qsl * 1e3, conc, wall, ok, nerr))


def goal_check(s, c):
    """Issue 25's goal on rows s (serial) and c (concurrent)."""
    print("mean TTFT ratio concurrent/serial: %.3f" % (c[3] / s[3]))
    goal = s[3] - s[6][3]
    print("issue 25 goal: concurrent mean TTFT %.1f ms <= serial mean TTFT %.1f ms - decode's "
          "queueing under serial %.1f ms = %.1f ms: %s (margin %.1f ms)"
          % (c[3] * 1e3, s[3] * 1e3, s[6][3] * 1e3, goal * 1e3,
             "holds" if c[3] <= goal else "does NOT hold", (goal - c[3]) * 1e3))


def compare_dispatch(args, reqs, modes):
    """The same workload, always disaggregated, once per --dispatch mode, the
    modes alternating --repeat times."""
    rows = []
    for rep in range(args.repeat):
        for mode in modes:
            res, errs, wall, pm, dm, dec = run(args, 0, reqs, "chat", mode)
            ts = [t for _, t in res]
            n = dec.get("pdproxy_decode_kv_wait_seconds_count", 0)
            wait = dec.get("pdproxy_decode_kv_wait_seconds_sum", 0) / n if n else float("nan")
            fetch = dm.get("engine_sim_kv_fetch_seconds_total", 0)
            nf = dm.get("engine_sim_kv_fetches_total", 0)
            conc = sum(v for k, v in dec.items()
                       if k.startswith("pdproxy_dispatch_total") and 'mode="concurrent"' in k)
            rows.append((mode, pct(ts, 0.5), pct(ts, 0.9), mean(ts), wait,
                         fetch / nf if nf else float("nan"), decode_queue(dm), conc, wall,
                         len(res), len(errs)))
            if errs:
                print("errors with --dispatch %s: %s" % (mode, errs[:3]), file=sys.stderr)
    print("\n" + HEAD)
    for r in rows:
        print_row(*r)
    by = {m: [r for r in rows if r[0] == m] for m in modes}
    if args.repeat > 1:
        med = {}
        for m, rs in by.items():
            col = lambda i: statistics.median(r[i] for r in rs)  # noqa: E731
            med[m] = (m, col(1), col(2), col(3), col(4), col(5),
                      tuple(statistics.median(r[6][i] for r in rs) for i in range(4)),
                      col(7), col(8), sum(r[9] for r in rs), sum(r[10] for r in rs))
        print("\nmedians over %d runs of each mode (ok and errors: totals)\n" % args.repeat + HEAD)
        for m in modes:
            print_row(*med[m])
    if "serial" in by and "concurrent" in by:
        for s, c in zip(by["serial"], by["concurrent"]):
            goal_check(s, c)
        if args.repeat > 1:
            print("on the medians:")
            goal_check(med["serial"], med["concurrent"])
    return 1 if any(r[10] for r in rows) else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tuned", type=int, default=512)
    ap.add_argument("--us-per-token", type=int, default=50)
    ap.add_argument("--deadline", type=float, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--endpoints", default="chat",
                    help="comma-separated: chat, responses, generate")
    ap.add_argument("--dispatch", default="",
                    help="comma-separated --dispatch modes to compare (serial,concurrent)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --dispatch: run the modes alternately this many times")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="tokens each request generates (16; 64 with --decode-busy)")
    ap.add_argument("--decode-busy", action="store_true",
                    help="decode engine-sim loaded as a real one: --itl-ms 20 --max-num-seqs 4")
    ap.add_argument("--decode-args", default="",
                    help="more engine-sim flags for decode, e.g. '--num-blocks 600'")
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "build", "bin"))
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    args.decode_sim_args = ((["--itl-ms", "20", "--max-num-seqs", "4"] if args.decode_busy else [])
                            + shlex.split(args.decode_args))
    MAX_TOKENS[0] = args.max_tokens or (64 if args.decode_busy else 16)
    if MAX_TOKENS[0] < 1:
        ap.error("--max-tokens must be at least 1")
    reqs = workload(args.requests, args.seed)
    endpoints = [e for e in args.endpoints.split(",") if e]
    for e in endpoints:
        if e not in ENDPOINTS:
            ap.error("unknown endpoint %r" % e)
    print("workload: %d streamed requests, concurrency %d, %d us per prompt token, "
          "%.1f bytes per token, %d tokens out; decode engine-sim extra flags: %s"
          % (len(reqs), args.concurrency, args.us_per_token, BYTES_PER_TOKEN, MAX_TOKENS[0],
             " ".join(args.decode_sim_args) or "none"))
    if args.dispatch:
        modes = [m for m in args.dispatch.split(",") if m]
        for m in modes:
            if m not in ("serial", "concurrent"):
                ap.error("unknown --dispatch mode %r" % m)
        return compare_dispatch(args, reqs, modes)
    rows = []
    for endpoint in endpoints:
        for threshold in (0, args.tuned):
            res, errs, wall, pm, dm, dec = run(args, threshold, reqs, endpoint)
            by = {k: [t for kk, t in res if kk == k] for k in ("short", "shared", "long")}
            rows.append((endpoint, threshold, mean([t for _, t in res]),
                         {k: mean(v) for k, v in by.items()},
                         pm.get("engine_sim_requests_total", 0),
                         pm.get("engine_sim_prompt_tokens_computed_total", 0),
                         dm.get("engine_sim_prompt_tokens_computed_total", 0), wall, len(res),
                         len(errs), dec))
            if errs:
                print("errors with %s, threshold %d: %s" % (endpoint, threshold, errs[:3]),
                      file=sys.stderr)
    print("\n| endpoint | --disagg-min-tokens | mean TTFT ms | short | shared prefix | long | "
          "prefill requests | prefill tokens computed | decode tokens computed | wall s | "
          "ok | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ep, th, m, by, preq, ptok, dtok, wall, ok, nerr, _ in rows:
        print("| %s | %d | %.1f | %.1f | %.1f | %.1f | %d | %d | %d | %.1f | %d | %d |"
              % (ep, th, m * 1e3, by["short"] * 1e3, by["shared"] * 1e3, by["long"] * 1e3, preq,
                 ptok, dtok, wall, ok, nerr))
    for ep, th, *_, dec in rows:
        print("decisions with %s, %d: %s" % (ep, th, ", ".join(
            "%s=%d" % (re.sub(r"^pdproxy_disagg_decisions_total", "", k), v)
            for k, v in sorted(dec.items()))))
    return 1 if any(r[9] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
