#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Control-plane scale figures for pdproxy with thousands of backends
(issue 30, item 3), on loopback:

  1. start: N backends (half prefill, half decode, literal 127.x.y.z
     addresses) in a --config file; seconds from spawn until the port
     accepts, and the "listening" line;
  2. reload: SIGHUP with a file that swaps 10 % of the backends; the swap
     time pdproxy logs (ms=) and SIGHUP to /ready's new generation;
  3. admin API: one add and one remove at N backends, round trip and the
     logged swap time;
  4. health checks: with --health-interval (default 5 s) against one
     engine-sim on 0.0.0.0 that every 127.x.y.z backend reaches, pdproxy's
     CPU use over --seconds, as a share of one core;
  5. SIGTERM while a file of --big backends loads: seconds to exit;
  6. latency (--only latency): requests through pdproxy to one engine-sim
     P/D pair (pool "m") while nothing changes, while the --n backends of
     another pool are reloaded from the file in a loop (10 % swapped each
     time), and while they are added and removed through the admin API in
     a loop: p50, p99 and max per phase, side by side, and the longest
     gap between two answers of that one-at-a-time stream (a pause of the
     data path during a swap shows there).

  python3 bench/control_plane.py [--build build] [--n 10000] [--big 100000]
                                 [--seconds 20] [--skip-health]
                                 [--only start,health,sigterm] [--policy P]

--only runs the named parts (start covers start, reload and admin);
--policy sets both pools' policy (prefix_affinity keeps a ring per pool,
which the admin API's changes update in place).
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from pdharness.net import HOST, free_port, port_accepts, wait_until  # noqa: E402


def addr(i):
    return "127.%d.%d.%d" % (1 + (i >> 16) % 250, (i >> 8) & 255, i & 255)


def write_file(path, n, port, shift=0, extra=""):
    half = n // 2
    pre = ["http://%s:%d" % (addr(i + shift), port) for i in range(half)]
    dec = ["http://%s:%d" % (addr(i + shift + 500000), port) for i in range(n - half)]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(extra)
        f.write("prefill:\n" + "".join("  - %s\n" % u for u in pre))
        f.write("decode:\n" + "".join("  - %s\n" % u for u in dec))
    os.replace(tmp, path)


def get(port, path, method="GET", body=None, token=None):
    req = urllib.request.Request("http://%s:%d%s" % (HOST, port, path), method=method,
                                 data=json.dumps(body).encode() if body is not None else None)
    if token:
        req.add_header("Authorization", "Bearer " + token)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def generation(port):
    return json.loads(get(port, "/ready")[1])["generation"]


def swaps(log):
    with open(log) as f:
        return [float(m) for m in re.findall(r'configuration swapped.*? ms=([0-9.]+)', f.read())]


def cpu_s(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sockets(pid):
    n = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            n += os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("socket:")
        except OSError:
            pass
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--big", type=int, default=100000)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--skip-health", action="store_true")
    ap.add_argument("--only", default="start,health,sigterm")
    ap.add_argument("--policy", default="round_robin")
    a = ap.parse_args()
    parts = set(a.only.split(","))
    if a.skip_health:
        parts.discard("health")
    pdproxy = os.path.join(a.build, "bin", "pdproxy")
    sim = os.path.join(a.build, "bin", "engine-sim")
    d = tempfile.mkdtemp(prefix="pdproxy-cp-")
    cfg, log = os.path.join(d, "c.yaml"), os.path.join(d, "pdproxy.log")
    tok = os.path.join(d, "token")
    with open(tok, "w") as f:
        f.write("control-plane-bench-token\n")
    engine = None
    procs = []
    try:
        eport = free_port()
        if "health" in parts:
            engine = subprocess.Popen([sim, "--role", "decode", "--host", "0.0.0.0", "--port",
                                       str(eport)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            procs.append(engine)
            wait_until(lambda: port_accepts(eport), 10)
        if "start" in parts:
            start_reload_admin(a, pdproxy, cfg, log, tok, eport, procs)
        if "health" in parts:
            health(a, pdproxy, cfg, log, eport, procs, engine)
        if "sigterm" in parts:
            sigterm(a, pdproxy, cfg, log, procs)
        if "latency" in parts:
            latency(a, pdproxy, sim, cfg, log, tok, procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)
    return 0


def start_reload_admin(a, pdproxy, cfg, log, tok, eport, procs):
    write_file(cfg, a.n, eport)
    port, aport = free_port(), free_port()
    argv = [pdproxy, "--config", cfg, "--host", HOST, "--port", str(port), "--threads", "2",
            "--health-interval", "0", "--admin-port", str(aport), "--admin-token-file", tok,
            "--prefill-policy", a.policy, "--decode-policy", a.policy]
    t0 = time.monotonic()
    px = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    procs.append(px)
    ok = wait_until(lambda: port_accepts(port) or px.poll() is not None, 600)
    t_start = time.monotonic() - t0
    if not ok or px.poll() is not None:
        print("pdproxy did not start; log:\n" + open(log).read()[-2000:])
        return 1
    # pdproxy's CPU time (user + system) as well: on a shared machine the
    # wall-clock figure grows with the load, the CPU time much less.
    print("start n=%d: %.3f s to listening, %.3f s CPU" % (a.n, t_start, cpu_s(px.pid)))

    # Reload: 10 % of the backends change.
    times, cpu = [], []
    for i in range(5):
        write_file(cfg, a.n, eport, shift=(i + 1) * (a.n // 10))
        g = generation(port)
        c0, t0 = cpu_s(px.pid), time.monotonic()
        px.send_signal(signal.SIGHUP)
        wait_until(lambda: generation(port) == g + 1, 120)
        times.append(time.monotonic() - t0)
        cpu.append(cpu_s(px.pid) - c0)
    wait_until(lambda: len(swaps(log)) >= 5, 10)  # the last line may lag /ready
    sw = swaps(log)
    print("reload n=%d: swap ms (logged) %s; SIGHUP to new generation s %s; CPU s %s"
          % (a.n, " ".join("%.1f" % x for x in sw[-5:]),
             " ".join("%.3f" % x for x in times), " ".join("%.3f" % x for x in cpu)))

    # Admin API: one add, one remove.
    token = "control-plane-bench-token"
    adds = []
    for i in range(5):
        u = "http://%s:%d" % (addr(900000 + i), eport)
        t0 = time.monotonic()
        st, body = get(aport, "/admin/backends", "POST", {"role": "prefill", "url": u}, token)
        adds.append((time.monotonic() - t0, st))
    rems = []
    for i in range(5):
        u = "http://%s:%d" % (addr(900000 + i), eport)
        t0 = time.monotonic()
        st, body = get(aport, "/admin/backends", "DELETE", {"role": "prefill", "url": u},
                       token)
        rems.append((time.monotonic() - t0, st))
    sw = swaps(log)
    print("admin n=%d: add round trips ms %s, remove ms %s; swaps logged ms %s"
          % (a.n, " ".join("%.1f(%d)" % (t * 1e3, s) for t, s in adds),
             " ".join("%.1f(%d)" % (t * 1e3, s) for t, s in rems),
             " ".join("%.2f" % x for x in sw[-10:])))
    px.send_signal(signal.SIGTERM)
    px.wait(60)


def health(a, pdproxy, cfg, log, eport, procs, engine):
    write_file(cfg, a.n, eport)
    port = free_port()
    argv = [pdproxy, "--config", cfg, "--host", HOST, "--port", str(port), "--threads",
            "2", "--health-interval", "5"]
    px = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    procs.append(px)
    wait_until(lambda: port_accepts(port) or px.poll() is not None, 600)
    # One round of checks first, then measure.
    time.sleep(6)  # bench pacing, not a readiness wait
    c0, e0, t0 = cpu_s(px.pid), cpu_s(engine.pid), time.monotonic()
    time.sleep(a.seconds)  # the measurement window
    c1, e1, t1 = cpu_s(px.pid), cpu_s(engine.pid), time.monotonic()
    print("health n=%d interval=5s: pdproxy CPU %.1f %% of one core over %.0f s (engine-sim "
          "%.1f %%); pdproxy holds %d sockets"
          % (a.n, 100 * (c1 - c0) / (t1 - t0), t1 - t0, 100 * (e1 - e0) / (t1 - t0),
             sockets(px.pid)))
    px.send_signal(signal.SIGTERM)
    px.wait(60)


def sigterm(a, pdproxy, cfg, log, procs):
    # SIGTERM during a long load.
    write_file(cfg, a.big, 9)
    port = free_port()
    argv = [pdproxy, "--config", cfg, "--host", HOST, "--port", str(port), "--threads", "2",
            "--health-interval", "0", "--drain-delay", "0"]
    px = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    procs.append(px)
    time.sleep(0.3)  # let the load begin
    t0 = time.monotonic()
    px.send_signal(signal.SIGTERM)
    try:
        px.wait(120)
        print("SIGTERM while loading %d backends: exited in %.3f s (status %s)"
              % (a.big, time.monotonic() - t0, px.returncode))
    except subprocess.TimeoutExpired:
        print("SIGTERM while loading %d backends: still running after 120 s" % a.big)


def latency(a, pdproxy, sim, cfg, log, tok, procs):
    import statistics
    import threading
    engines = []
    for role in ("prefill", "decode"):
        ep = free_port()
        procs.append(subprocess.Popen([sim, "--role", role, "--host", HOST, "--port", str(ep),
                                       "--model", "m", "--log-level", "warn"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_until(lambda: port_accepts(ep), 20)
        engines.append("http://%s:%d" % (HOST, ep))

    def layout(shift):
        half = a.n // 2
        pre = ["http://%s:9" % addr(i + shift) for i in range(half)]
        dec = ["http://%s:9" % addr(i + shift + 500000) for i in range(a.n - half)]
        text = ("pools:\n  - name: m\n    models: [m]\n    prefill: [%s]\n    decode: [%s]\n"
                "  - name: big\n    models: [big]\n    prefill: %s\n    decode: %s\n"
                % (engines[0], engines[1], json.dumps(pre), json.dumps(dec)))
        with open(cfg + ".tmp", "w") as f:
            f.write(text)
        os.replace(cfg + ".tmp", cfg)

    layout(0)
    port, aport = free_port(), free_port()
    px = subprocess.Popen([pdproxy, "--config", cfg, "--host", HOST, "--port", str(port),
                           "--threads", "2", "--health-interval", "0", "--admin-port",
                           str(aport), "--admin-token-file", tok, "--prefill-policy", a.policy,
                           "--decode-policy", a.policy],
                          stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    procs.append(px)
    wait_until(lambda: port_accepts(port) or px.poll() is not None, 120)
    token = "control-plane-bench-token"
    body = {"model": "m", "prompt": "hello there", "max_tokens": 1}

    def measure(change):
        stop = threading.Event()
        changes = [0]

        def loop():
            i = 0
            while not stop.is_set():
                i += 1
                change(i)
                changes[0] += 1

        t = threading.Thread(target=loop) if change else None
        lat, ends = [], []
        for _ in range(20):  # warm-up
            get(port, "/v1/completions", "POST", body)
        if t:
            t.start()
        end = time.monotonic() + a.seconds
        while time.monotonic() < end:
            t0 = time.monotonic()
            st, _ = get(port, "/v1/completions", "POST", body)
            ends.append(time.monotonic())
            lat.append((ends[-1] - t0) * 1e3)
            if st != 200:
                print("request failed: %d" % st)
        stop.set()
        if t:
            t.join(120)
        q = statistics.quantiles(lat, n=100)
        gap = max(b - e for e, b in zip(ends, ends[1:])) * 1e3
        return len(lat), q[49], q[98], max(lat), gap, changes[0]

    def reload_change(i):
        layout((i % 10) * (a.n // 10))
        g = generation(port)
        px.send_signal(signal.SIGHUP)
        wait_until(lambda: generation(port) != g, 60)

    def admin_change(i):
        u = "http://%s:9" % addr(900000 + i % 50)
        if i % 100 < 50:
            get(aport, "/admin/backends", "POST", {"pool": "big", "role": "decode", "url": u},
                token)
        else:
            get(aport, "/admin/backends", "DELETE", {"pool": "big", "role": "decode", "url": u},
                token)

    for name, change in (("none", None), ("reload loop", reload_change),
                         ("admin loop", admin_change), ("none again", None)):
        n, p50, p99, mx, gap, k = measure(change)
        print("latency n=%d policy=%s while %-11s: %d requests p50 %.2f ms p99 %.2f ms max "
              "%.2f ms, longest gap between answers %.2f ms (%d changes)"
              % (a.n, a.policy, name, n, p50, p99, mx, gap, k))
    px.send_signal(signal.SIGTERM)
    px.wait(60)


if __name__ == "__main__":
    sys.exit(main())
