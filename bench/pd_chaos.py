#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Kill run: pdproxy in front of an engine-sim P/D pair while a killer
SIGKILLs the prefill or the decode engine at random and restarts it on the
same port, for --duration seconds (default 300). Clients keep sending chat
completions, streamed and not, the whole time. Every request ends one way:

  ok      a complete answer (200; a stream ending with [DONE])
  error   a clean error: an HTTP error status with an OpenAI error body
  cut     a stream that started (200) and was cut (pdproxy's end for a decode
          that failed mid-stream: the client sees the connection close)
  lost    neither an answer nor an error: no status line before the client's
          timeout, or the connection closed without one

A clean error is not a loss. The run fails (exit 1) when any request is lost.

    bench/pd_chaos.py [--duration 300] [--concurrency 4] [--dispatch concurrent]
                      [--kill-every 2,6] [--down 0.5,2] [--us-per-token 20]
                      [--bin build/bin] [--seed 1]

Restarted engines get a new KV side-channel port (--kv-port 0), so the
identity pdproxy learned for a prefill goes stale: decode's held fetch then
fails and decode computes the prompt itself (engine-sim's default policy),
the case --dispatch concurrent must survive.

Python 3 standard library only; everything on 127.0.0.1; bounded in count
and time (each request --timeout seconds, the whole run --duration plus the
drain)."""

import argparse
import http.client
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests", "integration"))
from pdharness.net import HOST, free_port, wait_http
from pdharness.procs import Proc, start_proc
from pdharness.prom import prom

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly examine "
         "ancient manuscripts about distributed inference caching and scheduling").split()


def prompt(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 1500)))


def one(port, body, timeout):
    """Sends one request; returns ok, error, cut or lost."""
    stream = body.get("stream", False)
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request("POST", "/v1/chat/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
    except Exception:  # noqa: BLE001 (no status line: the classification is the point)
        c.close()
        return "lost"
    try:
        data = r.read()
    except Exception:  # noqa: BLE001
        data = None
    c.close()
    if r.status != 200:
        try:
            doc = json.loads(data or b"")
            return "error" if isinstance(doc.get("error"), dict) else "lost"
        except ValueError:
            return "lost"
    if data is None:
        return "cut"
    if stream:
        return "ok" if b"data: [DONE]" in data else "cut"
    try:
        return "ok" if json.loads(data).get("choices") else "lost"
    except ValueError:
        return "cut"


class Engine:
    """An engine-sim on a fixed port, killed and restarted by the killer."""

    def __init__(self, args, role):
        self.args, self.role = args, role
        self.port = free_port()
        self.proc = None
        self.kills = 0
        self.start()

    def argv(self):
        return [os.path.join(self.args.bin, "engine-sim"), "--role", self.role,
                "--port", str(self.port), "--num-blocks", "8192", "--block-bytes", "1024",
                "--layers", "2", "--prefill-us-per-token", str(self.args.us_per_token),
                "--itl-ms", "2", "--kv-expiry-ms", "20000", "--log-level", "warn"] + \
            (["--kv-transfer-mode", "push"] if self.args.dispatch == "concurrent" else [])

    def start(self):
        self.proc = Proc("%s-%d" % (self.role, self.port), self.argv())
        wait_http(self.port, "/health", timeout=15, proc=self.proc)

    def kill(self):
        self.proc.kill()
        os.unlink(self.proc.log_path)
        self.kills += 1

    def stop(self):
        self.proc.stop()
        os.unlink(self.proc.log_path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=300)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--dispatch", default="concurrent", choices=("serial", "concurrent"))
    ap.add_argument("--kill-every", default="2,6", help="seconds between kills: min,max")
    ap.add_argument("--down", default="0.5,2", help="seconds an engine stays down: min,max")
    ap.add_argument("--us-per-token", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "build", "bin"))
    args = ap.parse_args()
    kmin, kmax = map(float, args.kill_every.split(","))
    dmin, dmax = map(float, args.down.split(","))
    rng = random.Random(args.seed)
    P = Engine(args, "prefill")
    D = Engine(args, "decode")
    px = None
    counts = {"ok": 0, "error": 0, "cut": 0, "lost": 0}
    lock = threading.Lock()
    stop = threading.Event()
    try:
        px = start_proc("pdproxy", lambda port: [
            os.path.join(args.bin, "pdproxy"), "--port", str(port), "--threads", "2",
            "--log-level", "warn", "--access-log=false",
            "--prefill", "http://%s:%d" % (HOST, P.port),
            "--decode", "http://%s:%d" % (HOST, D.port),
            "--dispatch", args.dispatch, "--fallback-decode-only",
            "--prefill-timeout", "20", "--decode-idle-timeout", "20",
            "--health-interval", "0.5", "--connect-timeout", "2"], "/healthcheck")

        def client(seed):
            crng = random.Random(seed)
            while not stop.is_set():
                body = {"model": "sim-model", "max_tokens": crng.randint(1, 24),
                        "stream": crng.random() < 0.5,
                        "messages": [{"role": "user", "content": prompt(crng)}]}
                res = one(px.port, body, args.timeout)
                with lock:
                    counts[res] += 1
                if res != "ok":
                    time.sleep(0.05)  # a dead cluster is not hammered

        ths = [threading.Thread(target=client, args=(args.seed * 1000 + i,))
               for i in range(args.concurrency)]
        for t in ths:
            t.start()
        t_end = time.monotonic() + args.duration
        while time.monotonic() < t_end:
            time.sleep(min(rng.uniform(kmin, kmax), max(0.0, t_end - time.monotonic())))
            if time.monotonic() >= t_end:
                break
            e = rng.choice((P, D))
            e.kill()
            time.sleep(rng.uniform(dmin, dmax))
            e.start()
        stop.set()
        for t in ths:
            t.join(args.timeout + 10)
        hung = sum(t.is_alive() for t in ths)
        m = {}
        for name, labels, v in prom(px.port):
            key = name + ("{%s}" % ",".join('%s="%s"' % kv for kv in sorted(labels.items()))
                          if labels else "")
            m[key] = m.get(key, 0) + v
        total = sum(counts.values())
        print("%.0f s, --dispatch %s, concurrency %d: %d requests; prefill killed %d times, "
              "decode %d times" % (args.duration, args.dispatch, args.concurrency, total,
                                   P.kills, D.kills))
        print("| ok | clean error | stream cut | lost | clients still hung |")
        print("|---|---|---|---|---|")
        print("| %d | %d | %d | %d | %d |" % (counts["ok"], counts["error"], counts["cut"],
                                            counts["lost"], hung))
        for k in sorted(m):
            if (k.startswith("pdproxy_dispatch_total") or
                    k.startswith("pdproxy_decode_only_fallbacks_total")) and m[k]:
                print("%s %d" % (k, m[k]))
        return 1 if counts["lost"] or hung else 0
    finally:
        stop.set()
        if px is not None:
            px.stop()
            os.unlink(px.log_path)
        for e in (P, D):
            e.stop()


if __name__ == "__main__":
    sys.exit(main())
