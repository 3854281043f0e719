#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""KV-cache-aware routing benchmark: engine-sim with 4 prefill + 4 decode
instances behind pdproxy, a multi-tenant multi-turn chat workload, one run
per prefill policy.

Workload: --systems system prompts of ~--system-tokens tokens; --users
users, each bound to one system prompt, arriving as a Poisson process
(--rate users/s) and holding a conversation of --turns turns (each turn
adds a user message and the previous synthetic assistant reply, --think
seconds apart). Every prefill engine-sim computes prompts one at a time at
--us-per-token, its prefix cache (--cache-blocks blocks of 16 tokens, LRU)
skipped, so routing quality shows in time to first token and in prompt
tokens computed.

Policies: prefix_affinity_bytes is the former prefix_affinity (the first
256 bytes), prefix_affinity follows the prompt's whole block chain.
Reported per policy: TTFT p50/p90 (client side, streamed), prompt tokens
the prefill engines computed, the prefill engines' busy share (computed
tokens x --us-per-token over 4 x wall time: how near saturation the run
was), pdproxy's pdproxy_tokenize_total by result (kv_aware: exact tokens
or the byte estimate), their prefix cache hit rate (engine-sim's
vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total), and the
same figures for an oracle: the requests replayed in the order they were
sent, each placed on the engine with the longest cached prefix (fewest
requests on a tie) over LRU caches of the same size and block rule (whole
blocks, never the last token).

    bench/kv_routing.py [--policies round_robin,prefix_affinity_bytes,prefix_affinity,kv_aware]
                        [--systems 40 --system-tokens 2000 --users 400 --turns 5]
                        [--proxy-arg ARG]... [--bin build/bin]

The default is scaled down to finish in a few minutes on 2 cores; --issue
runs issue 24's size (about 4 minutes for the four policies). A policy
pdproxy rejects at start (kv_aware before it exists) is reported as
skipped. --proxy-arg strings are passed to pdproxy for every policy; in
them {prefill_kv_events}, {prefill_kv_replay} and {decode_kv_events} stand
for the engines' ZeroMQ endpoints (space-separated, in port order).

Python 3 standard library only; everything on loopback addresses (each engine
on one of its own, 127.0.0.11-14 and .21-24); bounded in count
and time (each request 60 s, each policy --deadline seconds)."""

import argparse
import collections
import hashlib
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "integration"))
from pdharness.net import HOST, free_port
from pdharness.procs import Proc, start_proc

BS = 16
VOCAB = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu cache block prefix token engine route decode prefill tenant session").split()


def text(n, rng):
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def conversations(args):
    """[(arrival s, system index, [messages of turn 1], [... of turn 2], ...)]."""
    rng = random.Random(args.seed)
    systems = [text(args.system_tokens, random.Random(args.seed * 1000 + i))
               for i in range(args.systems)]
    out, t = [], 0.0
    for u in range(args.users):
        t += rng.expovariate(args.rate)
        s = rng.randrange(args.systems)
        msgs = [{"role": "system", "content": systems[s]}]
        turns = []
        for k in range(args.turns):
            msgs = msgs + [{"role": "user", "content": "user %d turn %d %s" %
                            (u, k, text(args.user_tokens, rng))}]
            turns.append(msgs)
            msgs = msgs + [{"role": "assistant", "content": text(args.reply_tokens, rng)}]
        out.append((t, s, turns))
    return out


def stream_ttft(port, msgs, timeout=60):
    body = json.dumps({"model": "sim-model", "max_tokens": 4, "stream": True,
                       "messages": msgs})
    t0 = time.monotonic()
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError("status %d: %r" % (r.status, r.read()[:200]))
        ttft, done = read_stream(r, t0)
        if not done:
            raise RuntimeError("stream without [DONE]")
        return ttft if ttft is not None else time.monotonic() - t0
    finally:
        c.close()


def read_stream(r, t0):
    """Reads a chat completion's SSE answer: (seconds from t0 to its first
    content, or None; whether it ended with [DONE])."""
    ttft, buf = None, b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        if ttft is None and b'"content":"' in buf.replace(b'"content":""', b""):
            ttft = time.monotonic() - t0
    return ttft, b"[DONE]" in buf


def tokenize(addr, msgs):
    c = http.client.HTTPConnection(addr[0], addr[1], timeout=30)
    try:
        c.request("POST", "/tokenize", json.dumps({"messages": msgs}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        doc = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError("tokenize: %r" % doc)
        return doc["tokens"]
    finally:
        c.close()


def engine_get(host, port, path):
    c = http.client.HTTPConnection(host, port, timeout=5)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def wait_engine(host, port, proc, timeout=15.0):
    """Polls GET /health on host:port until 200 (bounded)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not proc.alive():
            raise RuntimeError("%s exited early:\n%s" % (proc.name, proc.log()))
        try:
            if engine_get(host, port, "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError("engine %s:%d not ready after %.0fs" % (host, port, timeout))


def engine_metrics(host, port):
    """{name: value} of an engine's /metrics, labels dropped."""
    out = {}
    for line in engine_get(host, port, "/metrics")[1].splitlines():
        if not line or line[0] == "#":
            continue
        name, _, value = line.rpartition(" ")
        out[name.split("{")[0]] = float(value)
    return out


def block_chain(tokens):
    """Chained hashes of the prompt's whole blocks."""
    out, h = [], b""
    for b in range(len(tokens) // BS):
        h = hashlib.blake2b(h + repr(tokens[b * BS:(b + 1) * BS]).encode(),
                            digest_size=8).digest()
        out.append(h)
    return out


class LruCache:
    """engine-sim's prefix cache (sim/prefix.c) in Python."""

    def __init__(self, cap):
        self.cap, self.d = cap, collections.OrderedDict()

    def match(self, chain, touch):
        n = 0
        for h in chain:
            if h not in self.d:
                break
            if touch:
                self.d.move_to_end(h)
            n += 1
        return n

    def insert(self, chain):
        for h in chain[:self.cap]:
            if h in self.d:
                self.d.move_to_end(h)
            else:
                if len(self.d) >= self.cap:
                    self.d.popitem(last=False)
                self.d[h] = True


def oracle(sent, engines, cap):
    """Hit rate and computed tokens with every request on the engine holding
    its longest cached prefix."""
    caches = [LruCache(cap) for _ in range(engines)]
    load = [0] * engines
    hits = queries = computed = 0
    for tokens in sent:
        chain = block_chain(tokens)
        usable = (len(tokens) - 1) // BS
        best = max(range(engines), key=lambda i: (caches[i].match(chain[:usable], False),
                                                   -load[i]))
        load[best] += 1
        cached = caches[best].match(chain[:usable], True) * BS
        hits += cached
        queries += len(tokens)
        computed += len(tokens) - cached
        caches[best].insert(chain)
    return hits, queries, computed


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def run_policy(args, policy, convs):
    sim = os.path.join(args.bin, "engine-sim")
    common = ["--num-blocks", "16384", "--block-bytes", "256", "--layers", "1",
              "--block-tokens", str(BS), "--prefix-cache-blocks", str(args.cache_blocks),
              "--itl-ms", "2", "--log-level", "warn"]
    procs = []
    try:
        pre, dec, ev = [], [], {"prefill_kv_events": [], "prefill_kv_replay": [],
                                "decode_kv_events": []}
        # Each engine on a loopback address of its own (127.0.0.11.. prefill,
        # 127.0.0.21.. decode) so that all publish on one events port, the
        # layout pdproxy's --kv-events-port expects (port relative to the
        # backend's address).
        evp = free_port()
        for role, lst, base in (("prefill", pre, 11), ("decode", dec, 21)):
            for i in range(4):
                host = "127.0.0.%d" % (base + i)
                pub = "tcp://%s:%d" % (host, evp)
                rep = "tcp://%s:%d" % (host, evp + 1)
                extra = ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep,
                         "--host", host, "--kv-host", host]
                if role == "prefill":
                    extra += ["--prefill-us-per-token", str(args.us_per_token)]
                    ev["prefill_kv_events"].append(pub)
                    ev["prefill_kv_replay"].append(rep)
                else:
                    ev["decode_kv_events"].append(pub)
                port = free_port()
                p = Proc("%s-%d" % (role, i), [sim, "--role", role, "--port", str(port)] +
                         common + extra)
                procs.append(p)
                wait_engine(host, port, p)
                lst.append((host, port))
        subst = {k: " ".join(v) for k, v in ev.items()}
        extra = []
        for a in args.proxy_arg:
            extra += a.format(**subst).split()
        try:
            xp = start_proc("pdproxy", lambda port: [
                os.path.join(args.bin, "pdproxy"), "--port", str(port), "--threads", "1",
                "--log-level", "warn", "--access-log=false", "--drain-delay", "0",
                "--prefill-policy", policy,
                "--prefiller-hosts"] + [h for h, _ in pre] + ["--prefiller-ports"] +
                [str(p) for _, p in pre] + ["--decoder-hosts"] + [h for h, _ in dec] +
                ["--decoder-ports"] + [str(p) for _, p in dec] + extra +
                (["--kv-events-port", str(evp), "--kv-events-replay-port", str(evp + 1)]
                 if policy == "kv_aware" else []), "/healthcheck",
                track=procs.append).port
        except Exception as e:  # noqa: BLE001 (pdproxy refused the policy or flags)
            log = procs[-1].log() if procs else ""
            return {"skipped": "pdproxy did not start: %s %s" % (e, log.strip()[-300:])}

        ttfts, errors, sent = [], [], []
        lock = threading.Lock()
        deadline = time.monotonic() + args.deadline
        t0 = time.monotonic()

        def user(arrival, turns):
            time.sleep(max(0.0, t0 + arrival - time.monotonic()))
            for k, msgs in enumerate(turns):
                if time.monotonic() > deadline:
                    return
                with lock:
                    sent.append(msgs)
                try:
                    t = stream_ttft(xp, msgs)
                    with lock:
                        ttfts.append(t)
                except Exception as e:  # noqa: BLE001 (counted and reported)
                    with lock:
                        errors.append(str(e))
                time.sleep(args.think)

        ths = [threading.Thread(target=user, args=(a, turns)) for a, _, turns in convs]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = time.monotonic() - t0
        computed = hits = queries = 0
        for host, port in pre:
            m = engine_metrics(host, port)
            computed += m["engine_sim_prompt_tokens_computed_total"]
            hits += m["vllm:prefix_cache_hits_total"]
            queries += m["vllm:prefix_cache_queries_total"]
        tokz = collections.Counter()
        for line in engine_get(HOST, xp, "/metrics")[1].splitlines():
            if line.startswith("pdproxy_tokenize_total{"):
                res = line.split('result="', 1)[1].split('"', 1)[0]
                tokz[res] += float(line.rpartition(" ")[2])
        toks = [tokenize(pre[0], msgs) for msgs in sent]
        o_hits, o_queries, o_computed = oracle(toks, 4, args.cache_blocks)
        return {"requests": len(ttfts), "errors": len(errors), "first_error":
                errors[0] if errors else "", "wall": wall,
                "p50": pct(ttfts, 0.5) * 1e3, "p90": pct(ttfts, 0.9) * 1e3,
                "mean": statistics.mean(ttfts) * 1e3 if ttfts else float("nan"),
                "computed": computed, "hit": hits / queries if queries else 0,
                # Share of the prefill engines' time spent computing prompts.
                "util": computed * args.us_per_token / 1e6 / (4 * wall) if wall else 0,
                "tokenize": ",".join("%s=%d" % kv for kv in sorted(tokz.items())) or "-",
                "o_computed": o_computed, "o_hit": o_hits / o_queries if o_queries else 0}
    finally:
        for p in reversed(procs):
            p.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies",
                    default="round_robin,prefix_affinity_bytes,prefix_affinity,kv_aware")
    ap.add_argument("--systems", type=int, default=12)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--users", type=int, default=60)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=40)
    ap.add_argument("--reply-tokens", type=int, default=40)
    ap.add_argument("--rate", type=float, default=6.0, help="user arrivals per second")
    ap.add_argument("--think", type=float, default=0.5, help="seconds between turns")
    ap.add_argument("--us-per-token", type=int, default=150)
    ap.add_argument("--cache-blocks", type=int, default=256,
                    help="prefix cache of each prefill engine, in blocks of 16 tokens")
    ap.add_argument("--proxy-arg", action="append", default=[])
    ap.add_argument("--deadline", type=float, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "build", "bin"))
    ap.add_argument("--issue", action="store_true",
                    help="issue 24's size: 40 system prompts of 2000 tokens, 400 users x 5 "
                         "turns, 4096-block caches, 16 users/s (prefix_affinity_bytes keeps "
                         "the prefill engines ~80%% busy: near saturation)")
    args = ap.parse_args()
    if args.issue:
        args.systems, args.system_tokens, args.users, args.turns = 40, 2000, 400, 5
        args.cache_blocks, args.rate = 4096, 16.0
    convs = conversations(args)
    print("workload: %d system prompts x ~%d tokens, %d users x %d turns, %.1f users/s, "
          "%d us/token, cache %d blocks per prefill engine" %
          (args.systems, args.system_tokens, args.users, args.turns, args.rate,
           args.us_per_token, args.cache_blocks))
    print("\n| policy | requests | errors | TTFT p50 ms | TTFT p90 ms | mean ms | "
          "prefill tokens computed | hit rate | oracle computed | oracle hit rate | hit/oracle | "
          "prefill busy | tokenize | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rc, res = 0, {}
    for policy in args.policies.split(","):
        r = run_policy(args, policy, convs)
        res[policy] = r
        if "skipped" in r:
            print("| %s | skipped: %s |" % (policy, r["skipped"].replace("\n", " ")))
            continue
        if r["errors"]:
            rc = 1
        print("| %s | %d | %d | %.1f | %.1f | %.1f | %d | %.3f | %d | %.3f | %.2f | %.2f | %s | "
              "%.1f |" %
              (policy, r["requests"], r["errors"], r["p50"], r["p90"], r["mean"],
               r["computed"], r["hit"], r["o_computed"], r["o_hit"],
               r["hit"] / r["o_hit"] if r["o_hit"] else 0, r["util"], r["tokenize"], r["wall"]))
        if r["first_error"]:
            print("  first error: %s" % r["first_error"][:300])
        sys.stdout.flush()
    kv, old = res.get("kv_aware", {}), res.get("prefix_affinity_bytes", {})
    if "p90" in kv and "p90" in old and old["p90"] and kv["o_hit"]:
        print("\ngoals: kv_aware p90 TTFT / prefix_affinity_bytes p90 = %.2f (goal <= 0.5); "
              "kv_aware hit rate / oracle = %.2f (goal >= 0.9)" %
              (kv["p90"] / old["p90"], kv["hit"] / kv["o_hit"]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
