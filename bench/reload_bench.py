#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Reload figures for pdproxy's --config file, on loopback with engine-sim
P/D pairs:

  1. wrk load through pdproxy while the file is rewritten and SIGHUP sent
     RELOADS times (default 50), every reload removing one prefill and one
     decode backend and adding others: wrk's non-2xx responses and socket
     errors are the requests that failed;
  2. reload latency: the swap time pdproxy logs (ms=) and the time from
     SIGHUP until /ready reports the new generation;
  3. memory: pdproxy's RSS before and after COUNT (default 1000) more
     reloads.

  python3 bench/reload_bench.py [--build build] [--reloads 50] [--count 1000]
                                [--seconds 20] [--connections 16]
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from pdharness.net import HOST
from pdharness.procs import rss_bytes, start_proc
from pdharness.prom import metric, prom


def generation(port):
    try:
        with urllib.request.urlopen("http://%s:%d/ready" % (HOST, port), timeout=5) as r:
            return json.loads(r.read())["generation"]
    except urllib.error.HTTPError as e:
        return json.loads(e.read())["generation"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--reloads", type=int, default=50)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--connections", type=int, default=16)
    a = ap.parse_args()
    root = ROOT
    bindir = os.path.join(a.build, "bin")
    tmp = tempfile.mkdtemp(prefix="reload-bench-")
    procs = []
    try:
        engines = {"prefill": [], "decode": []}
        for role, n in (("prefill", 3), ("decode", 3)):
            for _ in range(n):
                p = start_proc("engine-sim-%s" % role,
                               lambda port: [os.path.join(bindir, "engine-sim"), "--role", role,
                                             "--port", str(port), "--num-blocks", "4096",
                                             "--log-level", "warn"],
                               "/health", timeout=20, track=procs.append)
                engines[role].append("http://%s:%d" % (HOST, p.port))
        cfg = os.path.join(tmp, "pdproxy.yaml")

        def layout(i):
            P, D = engines["prefill"], engines["decode"]
            text = "prefill: %s\ndecode: %s\n" % (
                json.dumps([P[i % 3], P[(i + 1) % 3]]), json.dumps([D[i % 3], D[(i + 1) % 3]]))
            with open(cfg + ".tmp", "w") as f:
                f.write(text)
            os.replace(cfg + ".tmp", cfg)

        layout(0)
        px = start_proc("pdproxy",
                        lambda port: [os.path.join(bindir, "pdproxy"), "--config", cfg, "--port",
                                      str(port), "--threads", "2", "--drain-delay", "0",
                                      "--log-level", "info"],
                        "/ready", timeout=20, track=procs.append)
        port = px.port
        gen = [generation(port)]

        def reload_once(i):
            layout(i)
            t0 = time.monotonic()
            os.kill(px.proc.pid, signal.SIGHUP)
            want = gen[0] + 1
            while generation(port) != want:
                if time.monotonic() - t0 > 30:
                    raise RuntimeError("reload %d not seen" % i)
                time.sleep(0.001)
            gen[0] = want
            return (time.monotonic() - t0) * 1e3

        # 1. wrk while reloading.
        wrk = subprocess.Popen(["wrk", "-t2", "-c%d" % a.connections, "-d%ds" % a.seconds,
                                "-s", os.path.join(root, "deploy/wrk/completions.lua"),
                                "http://%s:%d" % (HOST, port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # The reloads start once wrk's requests arrive.
        deadline = time.monotonic() + 10
        while not metric(prom(port), "pdproxy_requests_total") and time.monotonic() < deadline:
            time.sleep(0.02)
        pause = max(0.0, (a.seconds - 3.0) / a.reloads)
        seen = []
        for i in range(1, a.reloads + 1):
            seen.append(reload_once(i))
            time.sleep(pause)
        out, _ = wrk.communicate(timeout=a.seconds + 60)
        total = re.search(r"(\d+) requests in", out)
        non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                         out)
        failed = (int(non2xx.group(1)) if non2xx else 0) + \
            (sum(int(x) for x in sock.groups()) if sock else 0)
        print("wrk -t2 -c%d -d%ds with %d reloads: requests=%s failed=%d (non-2xx=%s, socket "
              "errors=%s)" % (a.connections, a.seconds, a.reloads,
                              total.group(1) if total else "?", failed,
                              non2xx.group(1) if non2xx else 0,
                              sock.group(0) if sock else "none"))
        # 2 and 3: reloads without load.
        for i in range(a.reloads + 1, a.reloads + 21):  # warm-up
            reload_once(i)
        before = rss_bytes(px.proc.pid) // 1024
        for i in range(a.count):
            seen.append(reload_once(a.reloads + 21 + i))
        after = rss_bytes(px.proc.pid) // 1024
        swap = [float(m) for m in re.findall(r'configuration swapped".* ms=([0-9.]+)', px.log())]
        q = statistics.quantiles(swap, n=100)
        print("reloads=%d swap_ms p50=%.3f p99=%.3f max=%.3f; SIGHUP-to-/ready ms p50=%.2f "
              "max=%.2f" % (len(swap), q[49], q[98], max(swap), statistics.median(seen),
                            max(seen)))
        print("rss_kib before=%d after %d reloads=%d (delta %+d)" % (before, a.count, after,
                                                                   after - before))
        if not px.alive():
            print("pdproxy exited with %s" % px.proc.returncode)
            return 1
        return 0 if failed == 0 else 1
    finally:
        for p in procs:
            p.stop()
            os.unlink(p.log_path)


if __name__ == "__main__":
    sys.exit(main())
