#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Routing and admission by predicted latency (issue 42) against kv_aware:
engine-sim with 4 prefill engines of two speeds, 4 decode engines and one
slow prefill-decode link, behind pdproxy, under a bursty multi-tenant chat
load near saturation; one run per configuration, --repeat times, medians.

Engines: prefill 0 and 1 compute a prompt token in --fast-us, 2 and 3 in
--slow-us (one at a time, prefix cache skipped); decodes compute prompts
they serve alone at --decode-prefill-us a token and emit a token every
--itl-us; decode 0's KV link to prefill 0 adds --slow-link-ms to every
fetch (--kv-peer-cost). KV events feed the proxy's index (both policies
route cache hits).

Load: after --warmup seconds at the quiet rate (not counted), --tenants tenants, each with its own system prompts (--systems each,
~--system-tokens tokens) and TTFT target (--targets, ms, one per tenant,
sent as x-slo-ttft-ms by the client; the proxy also knows them from --slo
tenant=... specs); arrivals are a Poisson process whose rate alternates
between --burst-rate for --burst-s and --quiet-rate for --quiet-s
(bursts past what the engines serve, quiet spells under it); each request
is a new user message after a system prompt, streamed, --max-tokens long.

Configurations (--configs): kv_aware (both pools), latency (both pools; a
request predicted to miss its target is sent anyway: routing alone) and
latency_refuse (refused at once with Retry-After: routing and admission).

Reported per configuration (medians of the runs): goodput (requests whose
TTFT met their target, per second of the run), TTFT p50/p90 of the answered
requests, how many were refused, the prediction's relative error
|predicted - observed| / observed (median, p90; from the access lines'
pred_ttft_ms and ttfb_ms), the share of requests over the slow link and
on the slow prefills; then the ratios the issue sets (goodput >= 1.5x
kv_aware's, p90 <= 0.7x, error median <= 20 %). The machine's load average
is printed before and after every run: the figures mean little on a busy
machine.

    bench/latency_routing.py [--repeat 3] [--duration 30] [--configs kv_aware,latency,latency_refuse]
                             [--bin build/bin]

Python 3 standard library only; everything on loopback addresses (prefill
engines on 127.0.0.31-34, decodes on .41-44); bounded in count and time
(each request 60 s)."""

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "integration"))
from kv_routing import engine_metrics, pct, read_stream, text, wait_engine  # noqa: E402
from pdharness.net import HOST, free_port  # noqa: E402
from pdharness.procs import Proc, start_proc  # noqa: E402

CONFIGS = {
    "kv_aware": ["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware"],
    "latency": ["--prefill-policy", "latency", "--decode-policy", "latency"],
    "latency_refuse": ["--prefill-policy", "latency", "--decode-policy", "latency",
                       "--slo-miss", "refuse"],
}


def workload(args):
    """[(arrival s, tenant, messages, request id)]: --warmup seconds at the
    quiet rate (ids "w-N", not counted), then --duration seconds of bursts
    (ids "m-N")."""
    rng = random.Random(args.seed)
    systems = [[text(args.system_tokens, random.Random(args.seed * 1000 + t * 100 + s))
                for s in range(args.systems)] for t in range(args.tenants)]
    out, t, k = [], 0.0, 0
    period = args.burst_s + args.quiet_s
    while True:
        warm = t < args.warmup
        m = t - args.warmup
        rate = args.quiet_rate if warm or (m % period) >= args.burst_s else args.burst_rate
        t += rng.expovariate(rate)
        if t >= args.warmup + args.duration:
            return out
        ten = rng.randrange(args.tenants)
        msgs = [{"role": "system", "content": rng.choice(systems[ten])},
                {"role": "user", "content": "request %d %s" %
                 (k, text(rng.randint(args.user_tokens // 2, args.user_tokens * 3 // 2), rng))}]
        out.append((t, ten, msgs, "%s-%d" % ("w" if t < args.warmup else "m", k)))
        k += 1


def request(port, msgs, headers, max_tokens, timeout=60):
    """(status, ttft seconds or None, Retry-After)."""
    body = json.dumps({"model": "sim-model", "max_tokens": max_tokens, "stream": True,
                       "messages": msgs})
    h = {"Content-Type": "application/json"}
    h.update(headers)
    t0 = time.monotonic()
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request("POST", "/v1/chat/completions", body, h)
        r = c.getresponse()
        if r.status != 200:
            r.read()
            return r.status, None, r.getheader("Retry-After")
        ttft, done = read_stream(r, t0)
        return (200 if done else 599), ttft, None
    finally:
        c.close()


def access_lines(log):
    out = []
    for line in log.splitlines():
        if 'msg="request"' not in line:
            continue
        rec = {}
        for part in line.split(" "):
            k, _, v = part.partition("=")
            if v:
                rec[k] = v
        out.append(rec)
    return out


def run(args, config, load):
    sim = os.path.join(args.bin, "engine-sim")
    common = ["--num-blocks", "16384", "--block-bytes", "256", "--layers", "1",
              "--block-tokens", "16", "--prefix-cache-blocks", str(args.cache_blocks),
              "--log-level", "warn", "--max-num-seqs", "16"]
    procs = []
    try:
        pre, dec = [], []
        evp = free_port()
        for role, lst, base in (("prefill", pre, 31), ("decode", dec, 41)):
            for i in range(4):
                host = "127.0.0.%d" % (base + i)
                extra = ["--kv-events-endpoint", "tcp://%s:%d" % (host, evp),
                         "--kv-events-replay-endpoint", "tcp://%s:%d" % (host, evp + 1),
                         "--host", host, "--kv-host", host]
                if role == "prefill":
                    us = args.fast_us if i < 2 else args.slow_us
                    extra += ["--prefill-us-per-token", str(us), "--engine-id", "pf-%d" % i]
                else:
                    extra += ["--prefill-us-per-token", str(args.decode_prefill_us),
                              "--decode-us-per-token", str(args.itl_us)]
                    if i == 0:
                        extra += ["--kv-peer-cost", "pf-0=%g" % args.slow_link_ms]
                for attempt in range(3):  # a port free on 127.0.0.1 may not be on host
                    port = free_port()
                    p = Proc("%s-%d" % (role, i), [sim, "--role", role, "--port", str(port)] +
                             common + extra)
                    procs.append(p)
                    try:
                        wait_engine(host, port, p)
                        break
                    except RuntimeError:
                        if attempt == 2:
                            raise
                lst.append((host, port))
        slo = " ".join("tenant=t%d:ttft=%d" % (i, ms) for i, ms in enumerate(args.targets))
        xp = start_proc("pdproxy", lambda port: [
            os.path.join(args.bin, "pdproxy"), "--port", str(port), "--threads", "1",
            "--log-level", "warn", "--drain-delay", "0",
            "--kv-events-port", str(evp), "--kv-events-replay-port", str(evp + 1),
            "--tenant", " ".join("t%d" % i for i in range(args.tenants)), "--slo", slo,
            "--prefiller-hosts"] + [h for h, _ in pre] + ["--prefiller-ports"] +
            [str(p) for _, p in pre] + ["--decoder-hosts"] + [h for h, _ in dec] +
            ["--decoder-ports"] + [str(p) for _, p in dec] + CONFIGS[config],
            "/healthcheck", track=procs.append)
        results = []
        lock = threading.Lock()
        t0 = time.monotonic()
        load_before = os.getloadavg()

        def one(arrival, ten, msgs, rid):
            time.sleep(max(0.0, t0 + arrival - time.monotonic()))
            target = args.targets[ten]
            try:
                st, ttft, ra = request(xp.port, msgs, {"x-tenant": "t%d" % ten,
                                                       "x-slo-ttft-ms": str(target),
                                                       "X-Request-Id": rid},
                                       args.max_tokens)
            except Exception as e:  # noqa: BLE001 (counted as an error)
                st, ttft, ra = -1, None, str(e)
            if rid.startswith("m-"):
                with lock:
                    results.append((ten, st, ttft, target, ra))

        ths = [threading.Thread(target=one, args=a) for a in load]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = args.duration
        load_after = os.getloadavg()
        time.sleep(0.5)  # the access log's buffer (--access-log-flush 0.2 s)
        recs = [r for r in access_lines(xp.log()) if r.get("req", "").startswith("m-")]
        answered = [r for r in results if r[1] == 200 and r[2] is not None]
        met = [r for r in answered if r[2] * 1e3 <= r[3]]
        errs, by = [], {}
        for rec in recs:
            if "pred_ttft_ms" in rec and "ttfb_ms" in rec and rec.get("status") == "200":
                obs = float(rec["ttfb_ms"])
                if obs > 0:
                    e = (float(rec["pred_ttft_ms"]) - obs) / obs
                    errs.append(abs(e))
                    by.setdefault(rec.get("decision"), []).append(e)
        slow_link = "%s:%d" % pre[0], "%s:%d" % dec[0]
        served = [r for r in recs if r.get("status") == "200"]
        over_link = sum(1 for r in served if (r.get("prefill"), r.get("decode")) == slow_link)
        on_slow = sum(1 for r in served if r.get("prefill") in ("%s:%d" % pre[2], "%s:%d" % pre[3]))
        alone = sum(1 for r in served if r.get("decision") == "decode_only")
        busy = 0.0
        for i, (host, port) in enumerate(pre):
            m = engine_metrics(host, port)
            us = args.fast_us if i < 2 else args.slow_us
            busy += m["engine_sim_prompt_tokens_computed_total"] * us / 1e6
        return {
            "requests": len(results), "answered": len(answered),
            "refused": sum(1 for r in results if r[1] in (429, 503)),
            "errors": sum(1 for r in results if r[1] not in (200, 429, 503)),
            "goodput": len(met) / wall, "met_share": len(met) / len(results) if results else 0,
            "p50": pct([r[2] for r in answered], 0.5) * 1e3,
            "p90": pct([r[2] for r in answered], 0.9) * 1e3,
            "err_p50": pct(errs, 0.5) if errs else float("nan"),
            "err_p90": pct(errs, 0.9) if errs else float("nan"),
            # Signed errors by how the request was served: where the model
            # over- (> 0) or under-predicts (< 0).
            "err_by": " ".join("%s:n=%d,p10=%+.2f,p50=%+.2f,p90=%+.2f" %
                               (k, len(v), pct(v, 0.1), pct(v, 0.5), pct(v, 0.9))
                               for k, v in sorted(by.items())),
            "slow_link": over_link / len(served) if served else 0,
            "slow_prefill": on_slow / len(served) if served else 0,
            "decode_alone": alone / len(served) if served else 0,
            # Prompt tokens computed (the run's, its tail included) over 4 x the
            # window: above 1, the prefills worked past the window's end.
            "prefill_busy": busy / (4 * wall), "wall": wall,
            "load": "%.1f->%.1f" % (load_before[0], load_after[0]),
        }
    finally:
        for p in reversed(procs):
            p.stop()


COLS = ("goodput", "met_share", "p50", "p90", "refused", "errors", "err_p50", "err_p90",
        "slow_link", "slow_prefill", "decode_alone", "prefill_busy")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="kv_aware,latency,latency_refuse")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--warmup", type=float, default=6,
                    help="seconds at the quiet rate first, not counted (the model learns, the "
                         "caches fill, for every configuration)")
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--targets", default="1500,3000,6000",
                    help="each tenant's TTFT target, ms")
    ap.add_argument("--systems", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--user-tokens", type=int, default=300)
    ap.add_argument("--burst-rate", type=float, default=15.0)
    ap.add_argument("--burst-s", type=float, default=3.0)
    ap.add_argument("--quiet-rate", type=float, default=3.0)
    ap.add_argument("--quiet-s", type=float, default=3.0)
    ap.add_argument("--fast-us", type=int, default=1000)
    ap.add_argument("--slow-us", type=int, default=3000)
    ap.add_argument("--decode-prefill-us", type=int, default=3000)
    ap.add_argument("--itl-us", type=int, default=10000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--slow-link-ms", type=float, default=400)
    ap.add_argument("--cache-blocks", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "build", "bin"))
    args = ap.parse_args()
    args.targets = [int(x) for x in args.targets.split(",")]
    if len(args.targets) != args.tenants:
        ap.error("--targets needs one value per tenant")
    load = workload(args)
    print("workload: %d requests in %.0f s after a %.0f s warm-up (%.1f/s in %.0f s bursts, "
          "%.1f/s between), %d tenants "
          "(TTFT targets %s ms), prompts ~%d + ~%d tokens; prefills %d/%d us a token (2 each), "
          "decode 0 <- prefill 0 link +%.0f ms; %d CPUs" %
          (sum(1 for x in load if x[3][0] == "m"), args.duration, args.warmup, args.burst_rate, args.burst_s, args.quiet_rate,
           args.tenants, args.targets, args.system_tokens, args.user_tokens, args.fast_us,
           args.slow_us, args.slow_link_ms, os.cpu_count()))
    configs = args.configs.split(",")
    runs = {c: [] for c in configs}
    print("\n| run | config | requests | goodput/s | met | TTFT p50 ms | p90 ms | refused | "
          "errors | pred err p50 | p90 | slow link | slow prefill | decode alone | "
          "prefill busy | load 1m |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k in range(args.repeat):
        for c in configs:
            r = run(args, c, load)
            runs[c].append(r)
            print("| %d | %s | %d | %.2f | %.2f | %.0f | %.0f | %d | %d | %.3f | %.3f | %.3f | "
                  "%.3f | %.3f | %.2f | %s |" %
                  (k, c, r["requests"], r["goodput"], r["met_share"], r["p50"], r["p90"],
                   r["refused"], r["errors"], r["err_p50"], r["err_p90"], r["slow_link"],
                   r["slow_prefill"], r["decode_alone"], r["prefill_busy"], r["load"]))
            if r["err_by"]:
                print("|   | signed prediction errors: %s |" % r["err_by"])
            sys.stdout.flush()
    med = {c: {k: statistics.median(r[k] for r in runs[c]) for k in COLS} for c in configs}
    print("\nmedians of %d runs:\n" % args.repeat)
    print("| config | goodput/s | met | TTFT p50 ms | p90 ms | refused | pred err p50 | p90 |")
    print("|---|---|---|---|---|---|---|---|")
    for c in configs:
        m = med[c]
        print("| %s | %.2f | %.2f | %.0f | %.0f | %.0f | %.3f | %.3f |" %
              (c, m["goodput"], m["met_share"], m["p50"], m["p90"], m["refused"], m["err_p50"],
               m["err_p90"]))
    base = med.get("kv_aware")
    if base:
        for c in configs:
            if c == "kv_aware":
                continue
            m = med[c]
            print("\n%s against kv_aware: goodput %.2fx (goal >= 1.5), TTFT p90 %.2fx (goal <= "
                  "0.7), prediction error median %.1f %% (goal <= 20 %%)" %
                  (c, m["goodput"] / base["goodput"] if base["goodput"] else float("inf"),
                   m["p90"] / base["p90"] if base["p90"] else float("nan"), m["err_p50"] * 100))
    return 0


if __name__ == "__main__":
    sys.exit(main())
