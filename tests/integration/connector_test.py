#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Two-process libkvconnector tests over UCX on 127.0.0.1.

Runs kvc_testpeer producers and consumers (line protocol, see
connector_peer.c) under the UCX_TLS of the environment.  Every wait is a
bounded read of the peer's stdout; nothing sleeps to wait for a server.

usage: connector_test.py --mode tcp|sm [case ...]
(KVC_TEST_TRACE=1: tracebacks and a few measurements on stdout)
"""
import json
import os
import random
import select
import signal
import socket
import sys
import time

from pdharness import connector as kvc
from pdharness.connector import (WIRE, Peer, consumer, fetch, hdr, hello_body, ids, pipelined,
                                 producer, publish, pump, roundtrip)
from pdharness.net import closed_port, wait_until, wait_value


# --------------------------------------------------------------- cases --

def case_roundtrip(P, D):
    remote = [3, 4, 5, 9, 20, 21, 22, 23]
    local = [10, 11, 12, 40, 50, 51, 52, 53]
    params = publish(P, "cmpl-abc-0-1234abcd", remote)
    kv = json.loads(params)
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_block_ids"] == remote and kv["remote_engine_id"] == P.engine
    assert kv["remote_request_id"] == "cmpl-abc-0-1234abcd" and kv["remote_port"] == P.port
    assert kv["remote_host"] == "127.0.0.1" and kv["tp_size"] == 1
    x = fetch(D, local, params)
    ev = D.event("FETCH_DONE", xfer=x)
    assert "bytes=%d" % (len(remote) * 2 * 4096) in ev, ev
    assert D.cmd("verify 7 %s %s" % (ids(remote), ids(local)), "VERIFY") == "VERIFY ok"
    P.event("RELEASED", req="cmpl-abc-0-1234abcd")
    # Second fetch reuses the cached handshake.
    params = publish(P, "second", [1, 2])
    fetch(D, [1, 2], params)
    D.event("FETCH_DONE")
    P.event("RELEASED", req="second")
    assert D.stat()["handshakes"] == "1"
    want = {"tcp": "proto=push", "sm": "proto=get"}[kvc.MODE]
    err = D.stderr()
    assert want in err, "expected %s in consumer log:\n%s" % (want, err)
    # What UCX really used: with sm the producer's pool is mapped into the
    # consumer (ucp_rkey_ptr works, gets are memcpy); with tcp only, nothing
    # is mapped and every lane is tcp.
    tl = [l for l in err.splitlines() if "transports=" in l][0]
    if kvc.MODE == "sm":
        assert "remote_memory=shared-mapped" in err, err
    else:
        assert "remote_memory=remote" in err and "transports=tcp" in tl, tl


def case_colon_id(P, D):
    req = "cmpl-x:y:z-0-deadbeef:3"
    params = publish(P, req, [30, 31])
    fetch(D, [0, 1], params)
    D.event("FETCH_DONE")
    assert D.cmd("verify 7 30,31 0,1", "VERIFY") == "VERIFY ok"
    P.event("RELEASED", req=req)


def case_tail(P, D):
    remote = [40, 41, 42, 43, 44, 45]
    params = publish(P, "tail", remote)
    fetch(D, [60, 61], params)
    D.event("FETCH_DONE")
    assert D.cmd("verify 7 44,45 60,61", "VERIFY") == "VERIFY ok"
    P.event("RELEASED", req="tail")


def case_zero_blocks(P, D):
    params = publish(P, "zero", [5, 6, 7])
    fetch(D, [], params)
    ev = D.event("FETCH_DONE")
    assert "bytes=0" in ev
    P.event("RELEASED", req="zero")


def case_expiry(P, D):
    params = publish(P, "exp", [8, 9], expiry=150)
    P.event("EXPIRED", req="exp", timeout=5)
    # A late fetch still reads (the engine decides what the bytes mean), and its
    # notification is "unrecognized": logged, counted, ignored.
    fetch(D, [], params)
    D.event("FETCH_DONE")
    P.event("UNKNOWN_NOTIFY", req="exp")
    st = P.stat()
    assert st["expired"] == "1" and st["unknown"] == "1", st


def case_unknown_id(P, D):
    params = json.loads(publish(P, "real", [1]))
    params["remote_request_id"] = "no:such:id"
    params["remote_block_ids"] = []
    fetch(D, [], json.dumps(params))
    D.event("FETCH_DONE")
    # No publication of this producer ever had that id with that token: the
    # notification is refused and counted, and raises no event.
    def counted():
        pump([P], 0.0)  # files P's events, so that its stdout never fills
        return P.stat()["denied"] != "0"
    assert wait_until(counted, 5.0, 0.05), "notification for an unknown id not counted"
    assert P.stat()["unknown"] == "1" and P.stat()["published_now"] == "1"
    assert not any("UNKNOWN_NOTIFY" in e for e in P.events)


def case_out_of_range(P, D):
    params = publish(P, "oor", [1, 2])
    assert D.cmd("fetch 1,64 %s" % params, "ERR") == "ERR KVC_ERR_INVALID_PARAM"
    assert D.cmd("fetch 1,2,3 %s" % params, "ERR") == "ERR KVC_ERR_INVALID_PARAM"
    assert P.cmd("publish bad 1,99", "ERR") == "ERR KVC_ERR_INVALID_PARAM"
    bad = json.loads(params)
    bad["remote_block_ids"] = [1, 9999]
    fetch(D, [3, 4], json.dumps(bad))
    ev = D.event("FETCH_FAILED")
    assert "KVC_ERR_INVALID_PARAM" in ev, ev
    assert D.cmd("verify 7 1,2 3,4", "VERIFY").startswith("VERIFY bad")  # untouched


def case_version_mismatch(P, D):
    # 99: a future version; 2: the version before the sealed handshake.
    for v in ("99", "2"):
        P2 = producer("P-v" + v, env={"KVC_TEST_WIRE_VERSION": v})
        try:
            params = publish(P2, "v", [1])
            fetch(D, [1], params)
            ev = D.event("FETCH_FAILED")
            assert "KVC_ERR_VERSION" in ev and "speaks " + v in ev and "speaks 4" in ev, ev
            assert "KVC_ERR_AUTH" not in ev, ev
        finally:
            P2.close()


def case_layout_mismatch(P, D):
    P2 = producer("P-hnd", "--layout", "HND")
    P3 = Peer("P-geom", "--regions", "2", "--blocks", "32", "--block-len", "8192", *kvc.MEM)
    try:
        fetch(D, [1], publish(P2, "l", [1]))
        ev = D.event("FETCH_FAILED")
        assert "KVC_ERR_INCOMPATIBLE" in ev and "NHD" in ev and "HND" in ev, ev
        fetch(D, [1], publish(P3, "g", [1]))
        ev = D.event("FETCH_FAILED")
        assert "KVC_ERR_INCOMPATIBLE" in ev and "4096" in ev and "8192" in ev, ev
    finally:
        P2.close()
        P3.close()


def case_unreachable(P, D):
    port = closed_port()  # nothing listens there
    params = json.loads(publish(P, "u", [1]))
    params["remote_port"] = port
    t0 = time.monotonic()
    fetch(D, [1], json.dumps(params))
    ev = D.event("FETCH_FAILED", timeout=6)
    assert "KVC_ERR_UNREACHABLE" in ev, ev
    # A listener that never answers: the connect timeout (500 ms here) applies.
    D2 = consumer("D-to", "--connect-timeout-ms", "500")
    bh = socket.socket()
    bh.bind(("127.0.0.1", 0))
    bh.listen(1)
    try:
        params["remote_port"] = bh.getsockname()[1]
        t0 = time.monotonic()
        fetch(D2, [1], json.dumps(params))
        ev = D2.event("FETCH_FAILED", timeout=6)
        dt = time.monotonic() - t0
        assert "KVC_ERR_UNREACHABLE" in ev and "timed out" in ev, ev
        assert 0.4 < dt < 3.0, dt
    finally:
        bh.close()
        D2.close()


def case_killed_peer(P, D):
    K = producer("P-kill")
    try:
        fetch(D, [1], publish(K, "k1", [1]))
        D.event("FETCH_DONE")
        params = publish(K, "k2", [2, 3, 4])
        never = publish(K, "k3", [7])  # published, never fetched before the kill
        K.p.send_signal(signal.SIGSTOP)  # a peer that hangs, then dies
        x = fetch(D, [2, 3, 4], params)
        if kvc.MODE == "tcp":
            # Push protocol: nothing can arrive while the producer is stopped.
            # A fetch from a live producer issued after it is the later event:
            # D reports in order, so reading up to its FETCH_DONE files
            # whatever D said about the stuck fetch before.
            # (Another producer: P's own counts are checked at the end.)
            L = producer("P-live")
            try:
                y = fetch(D, [8], publish(L, "while-stopped", [8]))
                D.event("FETCH_DONE", xfer=y)
            finally:
                L.close()
            assert not any("FETCH_" in e for e in D.events), D.events
        K.kill()
        # tcp: the fetch fails when the endpoint does.  sm: the read is one-sided
        # through the mapping and may well have completed before the kill.
        ev = D.event(("FETCH_FAILED",) if kvc.MODE == "tcp" else ("FETCH_DONE", "FETCH_FAILED"),
                     timeout=10, xfer=x)
        # The dead producer's fetches fail; the agent keeps serving others.
        fetch(D, [5], params)
        ev = D.event("FETCH_FAILED", timeout=10)
        assert "UNREACHABLE" in ev or "PEER_FAILED" in ev, ev
        # A consumer that never met it: refused at once.
        D2 = consumer("D-late")
        try:
            fetch(D2, [7], never)
            ev = D2.event("FETCH_FAILED", timeout=10)
            assert "UNREACHABLE" in ev, ev
        finally:
            D2.close()
        fetch(D, [6], publish(P, "alive", [6]))
        D.event("FETCH_DONE")
        assert D.cmd("verify 7 6 6", "VERIFY") == "VERIFY ok"
        P.event("RELEASED", req="alive")
        st = P.stat()  # the live producer saw nothing of it
        assert (st["published"], st["released"], st["expired"], st["unknown"]) == \
            ("1", "1", "0", "0"), st
    finally:
        K.close(check=False)


def case_killed_peer_sm_only(P, D):
    # UCX_TLS=sm,self: no transport with peer-failure handling, so the
    # endpoints are made without it and UCX never reports the dead producer.
    # The side channel stays open (KVC_HFLAG_LIVE) and its close fails the
    # fetch at once, long before the 30 s data timeout.
    env = {"UCX_TLS": "sm,self"}
    K = Peer("P-smk", "--regions", "2", "--blocks", "64", "--block-len", "4096", "--user-mem",
             env=env)
    D2 = Peer("D-smk", "--regions", "2", "--blocks", "64", "--block-len", "4096", "--user-mem",
              "--xfer-timeout-ms", "30000", env=env)
    try:
        K.cmd("fill 3", "OK")
        fetch(D2, [1], publish(K, "m1", [1]))
        D2.event("FETCH_DONE")
        params = publish(K, "m2", [2, 3])
        K.p.send_signal(signal.SIGSTOP)  # pushes nothing: the fetch waits for it
        x = fetch(D2, [2, 3], params)
        t0 = time.monotonic()
        K.kill()
        ev = D2.event("FETCH_FAILED", timeout=10, xfer=x)
        dt = time.monotonic() - t0
        assert "KVC_ERR_PEER_FAILED" in ev and dt < 5.0, (ev, dt)
        assert "side channel" in D2.stderr(), D2.stderr()
    finally:
        K.close(check=False)
        D2.close()


def case_restart(P, D):
    K = producer("P-rs")
    port = K.port
    fetch(D, [1], publish(K, "r1", [1]))
    D.event("FETCH_DONE")
    K.kill()
    K.close(check=False)
    K = producer("P-rs", "--port", str(port))
    try:
        K.cmd("fill 9", "OK")
        fetch(D, [2], publish(K, "r2", [2]))
        D.event("FETCH_DONE")
        assert D.cmd("verify 9 2 2", "VERIFY") == "VERIFY ok"
        K.event("RELEASED", req="r2")
    finally:
        K.close()


def case_destroy_inflight(P, D):
    K = producer("P-stop")
    D2 = consumer("D-q")
    try:
        params = publish(K, "q", [1, 2])
        K.p.send_signal(signal.SIGSTOP)
        fetch(D2, [1, 2], params)
        D2.close()  # quit with the fetch in flight: clean exit, code 0
    finally:
        K.kill()
        K.close(check=False)


def case_stalled_peer(P, D):
    # Registered (not pool) memory: the data has to be pushed by the producer,
    # so a stopped producer stalls the fetch until xfer_timeout_ms.
    K = Peer("P-stall", "--regions", "2", "--blocks", "64", "--block-len", "4096", "--user-mem")
    D2 = Peer("D-stall", "--regions", "2", "--blocks", "64", "--block-len", "4096", "--user-mem",
              "--xfer-timeout-ms", "300")
    try:
        K.cmd("fill 5", "OK")
        fetch(D2, [1], publish(K, "s1", [1]))
        D2.event("FETCH_DONE")
        params = publish(K, "s2", [2, 3])
        K.p.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        x = fetch(D2, [2, 3], params)
        ev = D2.event("FETCH_FAILED", timeout=5, xfer=x)
        dt = time.monotonic() - t0
        assert "KVC_ERR_TIMED_OUT" in ev and 0.25 < dt < 3.0, (ev, dt)
        K.p.send_signal(signal.SIGCONT)
        # The stalled producer was dropped: the next fetch handshakes again.
        fetch(D2, [4, 5], publish(K, "s3", [4, 5]))
        D2.event("FETCH_DONE")
        assert D2.cmd("verify 5 4,5 4,5", "VERIFY") == "VERIFY ok"
        assert D2.stat()["handshakes"] == "2"
    finally:
        K.p.send_signal(signal.SIGCONT)
        K.close()
        D2.close()


def case_killed_consumer(P, D):
    # A consumer that dies mid-fetch costs the producer nothing but its own
    # pushes and the dead consumer's blocks, which expire and are counted; the
    # producer keeps serving the others.
    D1 = consumer("D-dies")
    try:
        fetch(D1, list(range(64)), publish(P, "big", list(range(64)), expiry=1500))
        D1.kill()
    finally:
        D1.close(check=False)
    roundtrip(P, D, "after", [5, 6], [1, 2])
    assert P.p.poll() is None
    # The fetch may or may not have finished before the kill (with sm the read
    # is one-sided): "big" ends released or expired, never stays published.
    P.event(("RELEASED", "EXPIRED"), req="big", timeout=6)
    st = P.stat()
    assert st["published"] == "2" and int(st["released"]) + int(st["expired"]) == 2 \
        and st["unknown"] == "0" and st["published_now"] == "0", st
    # Deterministic variant: the producer has to push (registered memory) and
    # is stopped while the consumer asks and dies, so no notification can
    # come: the blocks expire, and only they.
    K = producer("P-kc", *([] if "--user-mem" in kvc.MEM else ["--user-mem"]))
    D2 = consumer("D-dies-2")
    try:
        roundtrip(K, D2, "warm", [1], [1])  # handshake done: the fetch below only pulls
        params = publish(K, "lost", [10, 11, 12, 13], expiry=1500)
        K.p.send_signal(signal.SIGSTOP)
        fetch(D2, [10, 11, 12, 13], params)
        D2.kill()
        K.p.send_signal(signal.SIGCONT)
        roundtrip(K, D, "other", [20, 21], [20, 21])  # unaffected, during
        ev = K.event(("RELEASED", "EXPIRED", "UNKNOWN_NOTIFY"), req="lost", timeout=6)
        assert ev.split()[1] == "EXPIRED" and "n=4" in ev, ev
        roundtrip(K, D, "other-2", [30], [30])  # and after
        st = K.stat()
        assert (st["published"], st["released"], st["expired"], st["unknown"],
                st["published_now"]) == ("4", "3", "1", "0", "0"), st
    finally:
        K.p.send_signal(signal.SIGCONT)
        D2.close(check=False)
        K.close()


def case_many(P, D):
    # 200 concurrent requests, random-ish block ids, all verified.
    reqs = []
    for i in range(200):
        r = [(i * 7 + k * 13) % 64 for k in range(4)]
        r = list(dict.fromkeys(r))
        reqs.append((r, publish(P, "m%d" % i, r)))
    for i, (r, params) in enumerate(reqs):
        fetch(D, list(range(len(r))), params)
        D.event("FETCH_DONE")
        assert D.cmd("verify 7 %s %s" % (ids(r), ids(list(range(len(r))))), "VERIFY") == "VERIFY ok"
    for i in range(200):
        P.event("RELEASED", req="m%d" % i)



def garbage(kind, rnd):
    """What a hostile client sends on the side channel; None: nothing at all."""
    if kind == "random":
        b = bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(1, 4096)))
        return b"\x00" + b  # never starts with the magic
    if kind == "short-header":
        return hdr(WIRE, 1, 20)[:7]
    if kind == "truncated":  # a HELLO that promises more than it sends
        return hdr(WIRE, 1, 200) + hello_body("D-evil")[:9]
    if kind == "oversized":
        return hdr(WIRE, 1, 0xFFFFFFFF) + b"x" * 64
    if kind == "wrong-version":
        body = hello_body("D-evil")
        return hdr(0xBEEF, 1, len(body)) + body
    if kind == "wrong-type":  # a HANDSHAKE sent to the producer
        return hdr(WIRE, 2, 4) + b"\x00" * 4
    if kind == "bad-body":  # engine id length beyond the body
        return hdr(WIRE, 1, 6) + b"\xff\xff" + b"\x00" * 4
    if kind == "bad-address":  # a version-1 HELLO with a worker address of junk
        e = b"D-evil"
        addr = bytes(rnd.getrandbits(8) for _ in range(64))
        body = len(e).to_bytes(2, "little") + e + len(addr).to_bytes(4, "little") + addr
        return hdr(1, 1, len(body)) + body
    if kind == "silent":
        return None
    raise ValueError(kind)


GARBAGE = ["random", "short-header", "truncated", "oversized", "wrong-version", "wrong-type",
           "bad-body", "silent"]


def open_garbage(port, kind, rnd):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    data = garbage(kind, rnd)
    if data:
        try:
            s.sendall(data)
        except (ConnectionResetError, BrokenPipeError):
            pass  # closed on the first bytes: fine
    s.setblocking(False)
    return s


def wait_closed(socks, deadline):
    """Reads every socket until the producer closes it (EOF or reset)."""
    left = set(socks)
    while left:
        t = deadline - time.monotonic()
        if t <= 0:
            raise AssertionError("%d side-channel connections still open" % len(left))
        r, _, _ = select.select(list(left), [], [], t)
        for s in r:
            try:
                if not s.recv(65536):
                    left.discard(s)
            except (ConnectionResetError, BrokenPipeError):
                left.discard(s)
            except BlockingIOError:
                pass


def fd_count(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


def side_channel_conns(pid, port):
    """Connected sockets of `pid` whose local port is the side-channel port."""
    inodes = set()
    for f in ("/proc/%d/net/tcp" % pid, "/proc/%d/net/tcp6" % pid):
        try:
            with open(f) as fh:
                for row in fh.readlines()[1:]:
                    c = row.split()
                    if int(c[1].rsplit(":", 1)[1], 16) == port and c[3] != "0A":  # not LISTEN
                        inodes.add(c[9])
        except FileNotFoundError:
            pass
    n = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            link = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            n += 1
    return n


def case_garbage(P, D):
    # A producer whose side channel gets junk: it closes every such connection
    # (at once, or after its connect timeout for the ones that stall), leaks no
    # fd, and serves consumers' handshakes during and after.
    tmo = 3.0
    K = producer("P-junk", "--connect-timeout-ms", str(int(tmo * 1000)))
    D2 = consumer("D-during")
    rnd = random.Random(9)
    socks = []
    try:
        pid = K.p.pid
        roundtrip(K, D, "warm", [1, 2], [1, 2])  # D's endpoints exist before the baseline
        base = fd_count(pid)
        # Each kind alone: closed by the producer within its connect timeout.
        t0 = time.monotonic()
        socks = [open_garbage(K.port, k, rnd) for k in GARBAGE]
        wait_closed(socks, t0 + tmo + 3)
        for s in socks:
            s.close()
        assert K.p.poll() is None
        # 200 at once (over the producer's per-address limit of 64 handshakes
        # in progress: the oldest silent ones give way); a fresh consumer
        # handshakes and fetches meanwhile.
        t0 = time.monotonic()
        socks = [open_garbage(K.port, GARBAGE[i % len(GARBAGE)], rnd) for i in range(200)]
        roundtrip(K, D2, "during", [3, 4, 5, 40], [0, 1, 2, 3])
        roundtrip(K, D, "during-2", [6], [6])
        silent = [s for i, s in enumerate(socks) if GARBAGE[i % len(GARBAGE)] == "silent"]
        r, _, _ = select.select(silent, [], [], 0)
        assert len(r) < len(silent) and time.monotonic() - t0 < tmo, \
            "the round trip did not happen while the garbage was open"
        wait_closed(socks, time.monotonic() + tmo + 5)
        for s in socks:
            s.close()
        socks = []
        # No fd kept for the garbage: every accepted side-channel socket is
        # gone but the live side channels of D and D2 (kept open after their
        # handshakes, KVC_HFLAG_LIVE), and the fd count is back near the
        # baseline (D2's endpoints and side channel).
        def counts():
            pump([K], 0.0)  # files K's events, so that its stdout never fills
            return side_channel_conns(pid, K.port), fd_count(pid)
        n_sc, n_fd = wait_value(counts, lambda c: c[0] == 2 and c[1] <= base + 16, 10.0, 0.05)
        if not (n_sc == 2 and n_fd <= base + 16):
            raise AssertionError("producer fds: %d (baseline %d), side-channel sockets %d"
                                 % (n_fd, base, n_sc))
        if os.environ.get("KVC_TEST_TRACE"):
            print("fds: baseline %d, after %d" % (base, n_fd))
        # After: a new consumer handshakes; the old ones go on.
        D3 = consumer("D-after")
        try:
            roundtrip(K, D3, "after", [10, 11, 12], [20, 21, 22])
        finally:
            D3.close()
        roundtrip(K, D2, "after-2", [13], [13])
        st = K.stat()
        assert st["published"] == st["released"] == "5" and st["expired"] == "0" \
            and st["unknown"] == "0" and st["published_now"] == "0", st
        with open(K.errpath) as f:
            log = f.read()
        assert "malformed hello" in log and "too slow" in log and "wire version 48879" in log
    finally:
        for s in socks:
            s.close()
        D2.close()
        K.close()


def case_garbage_address(P, D):
    # A well-formed HELLO whose worker address is junk: the producer (which
    # connects back to the consumer's address on HELLO) must not hand it to
    # UCX unchecked; it stays up and serves the next consumer.
    K = producer("P-junkaddr")
    rnd = random.Random(5)
    try:
        s = open_garbage(K.port, "bad-address", rnd)
        try:
            wait_closed([s], time.monotonic() + 8)
        finally:
            s.close()
        assert K.p.poll() is None, "producer died on a junk worker address:\n" + K.stderr()
        roundtrip(K, D, "after-junk", [1, 2], [3, 4])
    finally:
        K.close(check=False)


def case_many_consumers(P, D):
    # One producer, 4 consumers, 1 000 requests published and all fetches
    # started before any is waited for; every fetch verified byte for byte and
    # every request released by its notification.  Bounded: 120 s in all.
    deadline = time.monotonic() + 120
    geo = ("--regions", "2", "--blocks", "1024", "--block-len", "4096")
    K = Peer("P-1k", *(geo + tuple(kvc.MEM)))
    Ds = []
    try:
        K.cmd("fill 11", "OK")
        for c in range(4):
            Ds.append(Peer("D-1k-%d" % c, *(geo + tuple(kvc.MEM))))
            Ds[-1].cmd("clear", "OK")
        N = 1000
        reqs = []  # (consumer, name, remote, local)
        for i in range(N):
            c, j = i % 4, i // 4
            n = 1 + i % 4
            s0 = (i * 37) % 1024
            remote = [(s0 + k) % 1024 for k in range(n)] if i % 2 else \
                [(s0 + k * 97) % 1024 for k in range(n)]
            local = [j * 4 + k for k in range(n)]
            reqs.append((c, "r1k-%d-%d" % (c, j), remote, local))
        lines = pipelined(K, ["publish %s %s" % (r, ids(rem)) for _, r, rem, _ in reqs],
                          "PUBLISHED")
        params = [l.split(" ", 1)[1] for l in lines]
        xfers = [dict() for _ in range(4)]  # xfer id -> request index
        B = 25
        for b in range(0, N // 4, B):  # the 4 consumers' fetches interleaved
            for c in range(4):
                mine = [i for i in range(N) if reqs[i][0] == c][b:b + B]
                got = pipelined(Ds[c], ["fetch %s %s" % (ids(reqs[i][3]), params[i]) for i in mine],
                                "", others=[K] + Ds, batch=B)
                for i, l in zip(mine, got):
                    assert l.startswith("FETCHING"), l
                    xfers[c][l.split()[1]] = i
        assert sum(len(x) for x in xfers) == N
        # Wait for all of it, reading every peer so none stalls on its stdout.
        while not (all(d.count("FETCH_DONE") + d.count("FETCH_FAILED") >= N // 4 for d in Ds)
                   and K.count("RELEASED") + K.count("EXPIRED") + K.count("UNKNOWN_NOTIFY") >= N):
            if time.monotonic() > deadline:
                raise AssertionError("not done in 120 s: fetches done %s, released %d"
                                     % ([d.count("FETCH_DONE") for d in Ds], K.count("RELEASED")))
            pump([K] + Ds, min(1.0, deadline - time.monotonic()))
        for c, d in enumerate(Ds):
            failed = [e for e in d.events if e.split()[1] == "FETCH_FAILED"]
            assert not failed, failed[:3]
            done = {}
            for e in d.events:
                f = dict(kv.split("=", 1) for kv in e.split()[2:6])
                done[f["xfer"]] = f
            assert set(done) == set(xfers[c]), "consumer %d: fetches done != started" % c
            for x, i in xfers[c].items():
                _, name, remote, local = reqs[i]
                assert done[x]["req"] == name and done[x]["n"] == str(len(local)), (done[x], name)
            mine = [reqs[i] for i in sorted(xfers[c].values())]
            rem = [b for r in mine for b in r[2]]
            loc = [b for r in mine for b in r[3]]
            assert d.cmd("verify 11 %s %s" % (ids(rem), ids(loc)), "VERIFY") == "VERIFY ok"
            st = d.stat()
            assert st["fetch_done"] == str(N // 4) and st["fetch_failed"] == "0" \
                and st["handshakes"] == "1", st
        rel = {e.split()[4][4:] for e in K.events if e.split()[1] == "RELEASED"}
        assert rel == {r[1] for r in reqs}, "released %d of %d" % (len(rel), N)
        st = K.stat()
        assert st["published"] == st["released"] == str(N) and st["expired"] == "0" \
            and st["unknown"] == "0" and st["published_now"] == "0", st
    finally:
        for d in Ds:
            d.close()
        K.close()


CASES = [case_roundtrip, case_colon_id, case_tail, case_zero_blocks, case_expiry,
         case_unknown_id, case_out_of_range, case_version_mismatch, case_layout_mismatch,
         case_unreachable, case_killed_peer, case_killed_peer_sm_only, case_restart,
         case_destroy_inflight, case_stalled_peer, case_killed_consumer,
         case_many, case_garbage, case_garbage_address,
         case_many_consumers]


def main():
    args = kvc.set_mode(sys.argv[1:])
    os.environ.setdefault("KVC_SECRET", "integration-test-cluster-secret")
    return kvc.run_cases(CASES, args)


if __name__ == "__main__":
    sys.exit(main())
