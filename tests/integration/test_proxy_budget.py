#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The fast path's budget: system calls and heap allocations per request
through both hops (prefill, then decode), counted exactly over a fixed
number of requests against canned mock engines, with pdproxy's default
flags (the access log on). A feature that adds a system call or an
allocation to every request fails here until BUDGET is raised, on purpose,
in the same commit.

System calls are counted by strace -c attached to every thread of pdproxy
(the log writer's and the control thread's included) while the requests
run; allocations by bench/alloc_count.c preloaded into a second pdproxy
(malloc, calloc and realloc, read on SIGUSR2 before and after)."""

import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time

from pdharness.canned import REQ_BODY, canned_engines, drive
from pdharness.case import PxTestCase, main
from pdharness.net import wait_until
from pdharness.procs import BIN_DIR, PDPROXY, sanitized

# Per proxied request, over REQUESTS requests once the keep-alive pools are
# warm. How they were set: the floor for two hops is one read and one write
# on each of the three sockets (client, prefill, decode): 6. Measured 6.05
# to 6.07 after issue 36 (10.03 before: a recv peek per reuse on each leg,
# getpeername and an access-log write per request); the rest is the
# warm-up's connections closing, the first reuses after the warm-up's pause
# (peeked at: idle over a second), the access log's batches and its thread's
# wake-ups. epoll_wait depends on how requests interleave (one wait per
# event when they come one at a time, far fewer under load), so it has a
# bound of its own: the three events of a request in sequence (client
# readable, prefill answered, decode answered); measured 0.8 to 1.05.
# What time rather than requests costs (the access log's flush timer and
# its thread's wake-ups, 20 a second; a peek at a connection idle over a
# second, when the client paused) has an allowance per second of the measured
# run: on a loaded machine the same requests take three times as long
# (measured 6.15 per request there, 0.06 of it futex calls of the timer).
# Allocations (malloc + calloc + realloc): measured 19.05 to 19.09, the
# same as before issue 36; 18.05 once a worker kept freed requests' blocks
# for the next ones (budget lowered from 20 to 19). calloc on its own: 5 a
# request took the arena's slow path (glibc's calloc never uses the
# per-thread cache); px_xcalloc zeroes small blocks from malloc instead,
# measured 0.02 (the warm-up's connections), budget 0.5. With the
# request's small blocks (libevent's chains, px_buf rooms, the upstream
# exchange's objects) kept per thread by px_mem (base/util.h): 0.01, budget
# 1: a new malloc per request fails it. What px_mem serves from its cache
# is not a malloc call and does not count here (nor would more, while this
# test's few clients keep fewer than PX_MEM_KEEP blocks of a class in
# flight); its instructions do.
# Instructions per request (user space, callgrind, every thread; what
# neither a loaded machine nor a shared one blurs): 148,500 before issue 36
# against bench/insn_per_req.sh's nginx mocks, 97,400 after its first
# round, 71,300 after the second (the prefill answer and the client body
# read once, string scans by word); measured here, against canned_engines'
# answers, 60,970 as built by default (link-time optimised), 63,700 without
# (63,670 to 63,800 in three runs, 4 clients). The budgets leave ~8% for
# other compilers and libevent builds; they hold for optimised builds (a
# Debug build is not measured).
# Per KiB of a long prompt (16 KiB, 200 requests, beside the short ones):
# 13,765 when the body was scanned three times (validated, then once by
# each leg's rewrite) and its buffer grew read by read; 7,190 with the
# legs' rewrites copying from the index's member list and the body's room
# taken at its first read. glibc's memcpy of large spans (rep movsb) counts
# one instruction a byte under callgrind: copies weigh more here than in
# time; a CPU whose memcpy uses vector loops counts fewer. With strings
# scanned 16 bytes at a time (SSE2, x86-64): 5,380 per KiB, and 59,400 for
# a short request (budget lowered from 66,000 to 64,000; the build without
# LTO was not measured again and keeps its 69,000). With prefill's
# kv_transfer_params listed while read (copied for decode without a third
# scan), header values scanned 16 bytes at a time and no snprintf for the
# answer's Content-Type: 54,730 (budget 59,000), 57,650 without LTO
# (budget 62,000). With request blocks reused, small zeroed blocks from
# malloc's per-thread cache, the head's end searched in place and an
# upstream exchange's rarely used events assigned only when used: 46,670
# (budget 51,000), 54,160 without LTO (budget 59,000). With log values
# checked by table, JSON keys told apart inline by their first byte and trace
# ids written 16 hex digits at once: 44,470 to 44,840 (budget 48,500), 51,970
# to 52,460 without LTO (budget 56,500). With the small blocks from px_mem's
# per-thread cache: 43,311 to 43,638 (budget 46,500), 50,806 to 51,260
# without LTO (budget 54,500).
# Idle anonymous memory (RssAnon) of one worker: measured 1.17 MiB after
# issue 36, of which ~0.8 MiB is the shared libraries' relocated data
# (libcrypto alone 404 KiB, ZeroMQ's dependencies ~250 KiB), heap and
# stacks the rest; 3.4 MiB before, when tables for features that were off
# (the dp_size declarations, 2 MiB; the admission queue's per-tenant flows,
# 160 KiB a worker) were allocated and touched at start.
BUDGET = {
    "syscalls": 6.05,    # every system call but epoll_wait, per request
    "syscalls_per_s": 60,  # ... and per second of the run
    "epoll_wait": 3.0,
    "allocations": 1.0,
    "calloc": 0.5,  # ... of them calloc (small zeroed blocks come from malloc)
    "instructions": 46500,  # user-space, every thread, per request (callgrind)
    "instructions_no_lto": 54500,  # ... built with -DPDPROXY_LTO=OFF
    "instructions_per_kib": 5800,  # ... and for each KiB of a long prompt (x86-64)
    "instructions_per_kib_no_sse2": 7800,  # ... where strings are scanned 8 bytes at a time
    "idle_anon_kib": 2048,
}
REQUESTS = 1000
CLIENTS = 4
LONG_PROMPT_KIB = 16  # ~4k tokens
LONG_REQUESTS = 200


def strace_counts(path):
    """{syscall: calls} from strace -c's summary table."""
    out = {}
    with open(path) as f:
        for line in f:
            p = line.split()
            # % time, seconds, usecs/call, calls, [errors,] syscall
            if len(p) >= 5 and p[-1] != "total" and p[3].isdigit() and p[0][0].isdigit():
                out[p[-1]] = int(p[3])
    return out


class BudgetTest(PxTestCase):
    def setUp(self):
        super().setUp()
        self.P, self.D = canned_engines(self)

    def proxy(self, env=None):
        return self.start_proxy([self.P.port], [self.D.port], threads=1, env=env)

    def skip_if_sanitized(self, px):
        if sanitized(px.proc.pid):
            self.skipTest("a sanitizer's runtime makes system calls and allocations of its own")

    def test_syscall_budget(self):
        strace = shutil.which("strace")
        if not strace:
            self.fail("strace is not installed (deploy/local/install-deps.sh)")
        px = self.proxy()
        self.skip_if_sanitized(px)
        self.assertEqual(drive(px.port, 200, CLIENTS), 200)  # pools warm
        out = tempfile.mktemp(prefix="pdproxy-strace-")
        self.addCleanup(lambda: os.path.exists(out) and os.unlink(out))
        tr = subprocess.Popen([strace, "-f", "-c", "-o", out, "-p", str(px.proc.pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        tasks = "/proc/%d/task" % px.proc.pid

        def traced():
            for t in os.listdir(tasks):
                with open("%s/%s/status" % (tasks, t)) as f:
                    if any(l.startswith("TracerPid:") and l.split()[1] == "0" for l in f):
                        return False
            return True
        if not wait_until(traced, 10, 0.02):
            tr.kill()
            self.fail("strace could not attach to pdproxy: %s" % tr.communicate()[1])
        t0 = time.monotonic()
        served = drive(px.port, REQUESTS, CLIENTS)
        took = time.monotonic() - t0
        tr.send_signal(signal.SIGINT)
        tr.communicate(timeout=20)
        self.assertEqual(served, REQUESTS)
        calls = strace_counts(out)
        per = {k: v / REQUESTS for k, v in calls.items()}
        table = "\n".join("  %-14s %7.3f" % kv for kv in sorted(per.items(), key=lambda x: -x[1]))
        other = sum(v for k, v in per.items() if k != "epoll_wait")
        allowed = BUDGET["syscalls"] + BUDGET["syscalls_per_s"] * took / REQUESTS
        self.assertLessEqual(other, allowed,
                             "system calls per request (epoll_wait aside) over the budget "
                             "(%.3f for %d requests in %.2f s):\n%s"
                             % (allowed, REQUESTS, took, table))
        self.assertLessEqual(per.get("epoll_wait", 0), BUDGET["epoll_wait"],
                             "epoll_wait per request over the budget:\n" + table)
        print("\nsystem calls per request (%d requests in %.2f s, budget %.3f):\n%s"
              % (REQUESTS, took, allowed, table))

    def test_idle_memory_budget(self):
        px = self.proxy()
        self.skip_if_sanitized(px)

        def anon():
            with open("/proc/%d/status" % px.proc.pid) as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1])
            return 0
        kib = anon()
        self.assertLessEqual(kib, BUDGET["idle_anon_kib"], "idle anonymous memory, KiB")
        print("\nidle anonymous memory: %d KiB" % kib)

    def test_instruction_budget(self):
        valgrind, control = shutil.which("valgrind"), shutil.which("callgrind_control")
        if not valgrind or not control:
            self.fail("valgrind is not installed (deploy/local/install-deps.sh)")
        self.skip_if_sanitized(self.proxy())
        build = subprocess.run([PDPROXY, "--version"], capture_output=True, text=True,
                               timeout=10).stdout
        kind = next((l for l in build.splitlines() if l.startswith("build:")), "")
        if not any(t in kind for t in ("Release", "RelWithDebInfo", "MinSizeRel")):
            self.skipTest("not an optimised build (%s)" % kind)
        budget = BUDGET["instructions" if "link-time" in kind else "instructions_no_lto"]
        out = tempfile.mktemp(prefix="pdproxy-callgrind-")
        self.addCleanup(lambda: [os.unlink(f) for f in (out, out + ".1", out + ".2", out + ".3")
                                 if os.path.exists(f)])
        px = self.start_proxy([self.P.port], [self.D.port], threads=1, ready_timeout=60,
                              prefix=[valgrind, "--tool=callgrind", "--callgrind-out-file=" + out])
        self.assertEqual(drive(px.port, 200, CLIENTS), 200)  # pools warm
        # Each dump writes the counts since the last one (out.1, out.2) and
        # zeroes them: the second holds the measured requests alone.
        # The third, requests whose prompt is LONG_PROMPT_KIB long: what
        # each KiB of a body costs (its scans and copies).
        long_body = REQ_BODY.replace(b'"prompt":"', b'"prompt":"' + b"x" * (LONG_PROMPT_KIB * 1024))
        for i, (n, body) in enumerate(((0, None), (REQUESTS, REQ_BODY), (LONG_REQUESTS, long_body))):
            if n:
                self.assertEqual(drive(px.port, n, CLIENTS, body=body), n)
            subprocess.run([control, "-d", str(px.proc.pid)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60, check=True)
            if i:
                self.assertTrue(wait_until(lambda: os.path.exists("%s.%d" % (out, i + 1)), 10),
                                "no callgrind dump")

        def total(k):
            with open("%s.%d" % (out, k)) as f:
                for line in f:
                    if line.startswith(("summary:", "totals:")):
                        return int(line.split()[1])
            self.fail("no totals in the callgrind dump")
        per = total(2) / REQUESTS
        per_kib = (total(3) / LONG_REQUESTS - per) / LONG_PROMPT_KIB
        kib_budget = BUDGET["instructions_per_kib" if platform.machine() in ("x86_64", "AMD64")
                            else "instructions_per_kib_no_sse2"]
        print("\ninstructions per request: %.0f (budget %d; %s); per KiB of prompt: %.0f "
              "(budget %d)" % (per, budget, kind, per_kib, kib_budget))
        self.assertLessEqual(per, budget, "instructions per request")
        self.assertLessEqual(per_kib, kib_budget, "instructions per KiB of a request's prompt")

    def test_allocation_budget(self):
        lib = os.path.join(os.environ.get("PX_BUILD_DIR") or os.path.join(BIN_DIR, ".."),
                           "lib", "alloc_count.so")
        probe = self.proxy()
        self.skip_if_sanitized(probe)
        self.assertTrue(os.path.exists(lib), "%s not built" % lib)
        counts = tempfile.mktemp(prefix="pdproxy-allocs-")
        self.addCleanup(lambda: os.path.exists(counts) and os.unlink(counts))
        px = self.proxy(env={"LD_PRELOAD": lib, "ALLOC_COUNT_OUT": counts})
        self.assertEqual(drive(px.port, 200, CLIENTS), 200)

        def lines():
            try:
                with open(counts) as f:
                    return f.read().split("\n")[:-1]
            except OSError:
                return []
        px.proc.send_signal(signal.SIGUSR2)
        self.assertTrue(wait_until(lambda: len(lines()) == 1, 5), "no count from alloc_count")
        served = drive(px.port, REQUESTS, CLIENTS)
        px.proc.send_signal(signal.SIGUSR2)
        self.assertTrue(wait_until(lambda: len(lines()) == 2, 5), "no count from alloc_count")
        self.assertEqual(served, REQUESTS)
        a, b = [list(map(int, l.split())) for l in lines()]
        per = sum(b) / REQUESTS - sum(a) / REQUESTS
        print("\nheap allocations per request: %.2f (malloc %.2f calloc %.2f realloc %.2f)"
              % (per, (b[0] - a[0]) / REQUESTS, (b[1] - a[1]) / REQUESTS,
                 (b[2] - a[2]) / REQUESTS))
        self.assertLessEqual(per, BUDGET["allocations"], "heap allocations per request")
        self.assertLessEqual((b[1] - a[1]) / REQUESTS, BUDGET["calloc"], "callocs per request")


if __name__ == "__main__":
    main()
