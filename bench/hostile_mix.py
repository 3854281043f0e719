#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Hostile mix: legitimate clients through pdproxy while, at the same time,
clients pipeline requests and never read, send bodies and stall, leave at
random points, a prefill answers 5xx in bursts, and (as root, with
unshare) one prefill backend name sits behind a DNS server that never
answers. Everything on loopback; bounded in time (DURATION, default 60 s,
at most 300) and in count.

Reports pdproxy's peak RSS, the legitimate requests lost (goal: 0), the
ejections and the limits' counters.

    bench/hostile_mix.py [build-dir]        DURATION=60 LEGIT=4
"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
os.environ.setdefault("PX_BIN_DIR", os.path.join(BUILD, "bin"))

from pdharness.client import RawClient, http_request
from pdharness.mocks import (MockBackend, Respond, Stream, completion_body, decode_handler,
                             prefill_handler, sse_events)
from pdharness.net import HOST, now
from pdharness.procs import rss_bytes, start_pdproxy
from pdharness.namespace import STALL_DNS, StallingDns, mount_prefix, unshare_usable
from pdharness.prom import metric, prom

DURATION = min(300.0, float(os.environ.get("DURATION", "60")))
LEGIT = int(os.environ.get("LEGIT", "4"))
MiB = 1 << 20


def rss(pid):
    try:
        return rss_bytes(pid)
    except OSError:  # gone
        return 0


class Burst:
    """A prefill handler that answers 500 while `on` is set."""

    def __init__(self):
        self.on = False
        self.ok = prefill_handler()

    def __call__(self, req):
        if self.on:
            return Respond(500, [("Content-Type", "application/json")], b'{"error":"burst"}')
        return self.ok(req)


def decode(req):
    doc = req.json()
    if doc.get("stream"):
        return Stream(200, [("Content-Type", "text/event-stream")],
                      [(0, e) for e in sse_events(["a", "b", "c"])])
    return decode_handler()(req)


def main():
    stop = threading.Event()
    end = now() + DURATION
    burst = Burst()
    P0 = MockBackend(burst, name="P0")
    P1 = MockBackend(prefill_handler(), name="P1")
    D = MockBackend(decode, name="D")
    args = ["--threads", "2", "--log-level", "info",
            "--drain-delay", "0", "--health-interval", "1",
            "--prefill", "http://%s:%d" % (HOST, P0.port),
            "--prefill", "http://%s:%d" % (HOST, P1.port),
            "--decode", "http://%s:%d" % (HOST, D.port),
            "--max-buffered-bytes", str(64 * MiB), "--send-timeout", "5",
            "--keepalive-timeout", "5", "--client-header-timeout", "10",
            "--max-connections", "2000", "--dns-refresh", "2"]
    prefix, tmp = [], []
    dns = unshare_usable()
    if dns:
        try:
            stalling = StallingDns()
        except OSError as e:
            print("no stalling DNS server (%s): DNS part skipped" % e)
            dns = False
    if dns:
        for text in ("127.0.0.1 localhost\n", "nameserver %s\n" % STALL_DNS):
            fd, path = tempfile.mkstemp(prefix="hostile-mix-")
            os.write(fd, text.encode())
            os.close(fd)
            tmp.append(path)
        prefix = mount_prefix(*tmp)
        args += ["--prefill", "http://stalled.hostile-mix:%d" % P1.port]
    spawned = []
    px = start_pdproxy(lambda p: ["--host", HOST, "--port", str(p)] + args, spawned.append,
                       prefix=prefix)
    for other in spawned[:-1]:  # tries on a port taken meanwhile
        other.stop()
        other.remove_logs()
    port, proc = px.port, px.proc
    pid = proc.pid
    rss0 = rss(pid)
    peak = [rss0]
    stats = {"legit_ok": 0, "legit_lost": 0, "lost_why": {}, "nonreaders": 0, "stallers": 0,
             "leavers": 0, "bursts": 0}
    lock = threading.Lock()

    def bump(k, n=1):
        with lock:
            stats[k] += n

    def legit(i):
        rng = random.Random(i)
        for _ in range(1000000):
            if now() >= end:
                return
            stream = rng.random() < 0.5
            body = completion_body(prompt="legit %d %s" % (i, "x" * rng.randint(10, 4000)),
                                   stream=stream)
            try:
                r = http_request(port, "POST", "/v1/completions", body, timeout=20)
                ok = r.status == 200 and (not stream or b"[DONE]" in r.body)
                why = "status %d" % r.status
            except Exception as e:  # counted, not raised: the run goes on
                ok, why = False, type(e).__name__
            if ok:
                bump("legit_ok")
            else:
                with lock:
                    stats["legit_lost"] += 1
                    stats["lost_why"][why] = stats["lost_why"].get(why, 0) + 1

    def hold(i, head, filler, total, piece, rcvbuf, count):
        """Connects, sends `head`, then `filler` bytes toward `total` as fast
        as pdproxy takes them, and holds the connection unread for a while:
        a non-reading pipeliner, or a body that stalls."""
        for _ in range(100000):
            if now() >= end:
                return
            try:
                s = socket.socket()
                if rcvbuf:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
                s.connect((HOST, port))
                s.sendall(head)
                s.setblocking(False)
                sent, t_end = 0, min(end, now() + 8)
                while sent < total and now() < t_end:
                    try:
                        off = sent % len(filler)  # the stream stays whole requests
                        sent += s.send(filler[off:off + min(piece, total - sent)])
                    except BlockingIOError:
                        time.sleep(0.05)
                    except OSError:
                        break
                while now() < t_end:
                    time.sleep(0.1)
                s.close()
                bump(count)
            except OSError:
                time.sleep(0.1)

    def nonreader(i):
        req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        hold(i, b"", req * 2000, len(req) * 20000, len(req) * 2000, 4096, "nonreaders")

    def staller(i):
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n" % (4 * MiB))
        hold(i, head, b" " * 65536, 3 * MiB, 65536, 0, "stallers")

    def leaver(i):
        rng = random.Random(100 + i)
        for _ in range(1000000):
            if now() >= end:
                return
            try:
                c = RawClient(port, timeout=5)
                c.request("POST", "/v1/completions", completion_body(stream=True))
                time.sleep(rng.uniform(0, 0.05))
                c.close(rst=rng.random() < 0.5)
                bump("leavers")
            except OSError:
                time.sleep(0.05)

    def bursts():
        for _ in range(100000):
            if now() >= end - 3:
                return
            time.sleep(4)
            burst.on = True
            bump("bursts")
            time.sleep(1)
            burst.on = False

    def sampler():
        for _ in range(1000000):
            if stop.is_set():
                return
            peak[0] = max(peak[0], rss(pid))
            for m in (P0, P1, D):
                with m._lock:
                    del m.requests[:]
            time.sleep(0.25)

    threads = [threading.Thread(target=f, args=(i,), daemon=True)
               for f, n in ((legit, LEGIT), (nonreader, 6), (staller, 6), (leaver, 2))
               for i in range(n)]
    threads += [threading.Thread(target=bursts, daemon=True),
                threading.Thread(target=sampler, daemon=True)]
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join(max(0.0, end - now() + 30))
    time.sleep(1)
    samples = prom(port)
    rss_end = rss(pid)
    stop.set()
    if dns:
        stalling.close()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
    text = px.stderr()
    ejections = len(re.findall(r'msg="backend ejected"', text))
    for m in (P0, P1, D):
        m.stop()
    px.remove_logs()
    for p in tmp:
        os.unlink(p)

    def g(name, **labels):
        v = metric(samples, name, **labels)
        return int(v) if v is not None else 0

    print("hostile mix: %.0f s, %d legitimate clients, DNS stall %s"
          % (DURATION, LEGIT, "on" if dns else "off (needs root and unshare)"))
    print("  legitimate requests: %d ok, %d lost %s" % (stats["legit_ok"], stats["legit_lost"],
                                                      json.dumps(stats["lost_why"])))
    print("  attackers: %d non-reading pipeliners, %d stalled bodies, %d leavers, %d 5xx bursts"
          % (stats["nonreaders"], stats["stallers"], stats["leavers"], stats["bursts"]))
    print("  pdproxy RSS: start %.1f MiB, peak %.1f MiB, end %.1f MiB"
          % (rss0 / MiB, peak[0] / MiB, rss_end / MiB))
    print("  ejections %d, panic routed %d, budget refusals %d, send timeouts %d, "
          "connections refused %d, DNS failures %d"
          % (ejections, g("pdproxy_panic_routed_total"), g("pdproxy_buffer_budget_rejected_total"),
             g("pdproxy_send_timeouts_total"), g("pdproxy_connections_refused_total"),
             g("pdproxy_dns_resolution_failures_total")))
    return 0 if stats["legit_lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
