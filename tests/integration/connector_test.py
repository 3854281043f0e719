#!/usr/bin/env python3
"""Two-process libkvconnector tests over UCX on 127.0.0.1.

Runs kvc_testpeer producers and consumers (line protocol, see
connector_peer.c) under the UCX_TLS of the environment.  Every wait is a
bounded read of the peer's stdout; nothing sleeps to wait for a server.

usage: connector_test.py --mode tcp|sm [case ...]
"""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

BIN = os.path.join(os.environ.get("PX_BIN_DIR", "build/bin"), "kvc_testpeer")
WAIT = 20.0  # generous bound for any single expected line


class Peer:
    def __init__(self, engine, *args, env=None):
        e = dict(os.environ)
        e.setdefault("KVC_LOG_LEVEL", "debug")
        e.setdefault("UCX_LOG_FILE", "/dev/stderr")  # UCX logs to stdout by default
        e.update(env or {})
        self.engine = engine
        self.errpath = "/tmp/kvc_test_%d_%s.err" % (os.getpid(), engine)
        self.err = open(self.errpath, "w+")
        self.p = subprocess.Popen([BIN, "--engine", engine] + list(args), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.err, env=e)
        self.buf = b""
        self.events = []
        line = self.expect("READY")
        self.port = int(line.split("port=")[1])

    def send(self, cmd):
        self.p.stdin.write((cmd + "\n").encode())
        self.p.stdin.flush()

    def readline(self, deadline):
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("%s: timed out; stderr:\n%s" % (self.engine, self.stderr()))
            r, _, _ = select.select([self.p.stdout], [], [], left)
            if r:
                chunk = os.read(self.p.stdout.fileno(), 65536)
                if not chunk:
                    raise AssertionError("%s: exited rc=%s; stderr:\n%s"
                                         % (self.engine, self.p.poll(), self.stderr()))
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        line = line.decode()
        if line.startswith("[") and " UCX " in line:  # a UCX log line, not ours
            return self.readline(deadline)
        return line

    def expect(self, prefix, timeout=WAIT):
        deadline = time.monotonic() + timeout
        while True:
            line = self.readline(deadline)
            if line.startswith("EVENT ") and not prefix.startswith("EVENT"):
                self.events.append(line)
                continue
            if line.startswith(prefix):
                return line
            if line.startswith("EVENT"):
                self.events.append(line)
                continue
            raise AssertionError("%s: expected %r, got %r" % (self.engine, prefix, line))

    def event(self, kind, timeout=WAIT, **match):
        """Next event of `kind` (a name or a tuple of names); earlier unmatched
        events are kept."""
        kinds = (kind,) if isinstance(kind, str) else kind
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev.split()[1] in kinds and all(("%s=%s" % kv) in ev for kv in match.items()):
                    return self.events.pop(i)
            line = self.readline(deadline)
            if line.startswith("EVENT "):
                self.events.append(line)

    def cmd(self, cmd, prefix):
        self.send(cmd)
        return self.expect(prefix)

    def stat(self):
        line = self.cmd("stat", "STAT")
        return dict(kv.split("=") for kv in line.split()[1:])

    def stderr(self):
        self.err.flush()
        with open(self.errpath) as f:
            return f.read()[-4000:]

    def close(self, check=True):
        if self.p.poll() is None:
            try:
                self.send("quit")
                self.p.stdin.close()
            except BrokenPipeError:
                pass
            try:
                rc = self.p.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                self.p.kill()
                raise AssertionError("%s: did not exit on quit" % self.engine)
            if check and rc != 0:
                raise AssertionError("%s: exit code %d; stderr:\n%s" % (self.engine, rc, self.stderr()))
        self.err.close()
        os.unlink(self.errpath)

    def kill(self):
        self.p.kill()
        self.p.wait()


def ids(v):
    return ",".join(str(x) for x in v) if v else "-"


MODE = "tcp"
MEM = []  # extra producer args


def producer(name="P", *args, env=None):
    p = Peer(name, "--regions", "2", "--blocks", "64", "--block-len", "4096", *(MEM + list(args)), env=env)
    p.cmd("fill 7", "OK")
    return p


def consumer(name="D", *args, env=None):
    d = Peer(name, "--regions", "2", "--blocks", "64", "--block-len", "4096", *(MEM + list(args)), env=env)
    d.cmd("clear", "OK")
    return d


def publish(p, req, blocks, expiry=None):
    line = p.cmd("publish %s %s%s" % (req, ids(blocks), " %d" % expiry if expiry else ""),
                 "PUBLISHED")
    return line.split(" ", 1)[1]


def fetch(d, local, params):
    line = d.cmd("fetch %s %s" % (ids(local), params), "")
    assert line.startswith("FETCHING"), line
    return line.split()[1]


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
    want = {"tcp": "proto=push", "sm": "proto=get"}[MODE]
    err = D.stderr()
    assert want in err, "expected %s in consumer log:\n%s" % (want, err)
    # What UCX really used: with sm the producer's pool is mapped into the
    # consumer (ucp_rkey_ptr works, gets are memcpy); with tcp only, nothing
    # is mapped and every lane is tcp.
    tl = [l for l in err.splitlines() if "transports=" in l][0]
    if MODE == "sm":
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
    P.event("UNKNOWN_NOTIFY", req="no:such:id")
    assert P.stat()["published_now"] == "1"


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
    P2 = producer("P-v99", env={"KVC_TEST_WIRE_VERSION": "99"})
    try:
        params = publish(P2, "v", [1])
        fetch(D, [1], params)
        ev = D.event("FETCH_FAILED")
        assert "KVC_ERR_VERSION" in ev and "99" in ev and "speaks 1" in ev, ev
    finally:
        P2.close()


def case_layout_mismatch(P, D):
    P2 = producer("P-hnd", "--layout", "HND")
    P3 = Peer("P-geom", "--regions", "2", "--blocks", "32", "--block-len", "8192", *MEM)
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
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
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
        K.p.send_signal(signal.SIGSTOP)  # a peer that hangs, then dies
        x = fetch(D, [2, 3, 4], params)
        if MODE == "tcp":
            # Push protocol: nothing can arrive while the producer is stopped.
            time.sleep(0.2)  # not a readiness wait: gives a stuck fetch the chance to show
            assert not any("FETCH_" in e for e in D.events), D.events
        K.kill()
        # tcp: the fetch fails when the endpoint does.  sm: the read is one-sided
        # through the mapping and may well have completed before the kill.
        ev = D.event(("FETCH_FAILED",) if MODE == "tcp" else ("FETCH_DONE", "FETCH_FAILED"),
                     timeout=10, xfer=x)
        # The dead producer's fetches fail; the agent keeps serving others.
        fetch(D, [5], params)
        ev = D.event("FETCH_FAILED", timeout=10)
        assert "UNREACHABLE" in ev or "PEER_FAILED" in ev, ev
        fetch(D, [6], publish(P, "alive", [6]))
        D.event("FETCH_DONE")
        assert D.cmd("verify 7 6 6", "VERIFY") == "VERIFY ok"
        P.event("RELEASED", req="alive")
    finally:
        K.close(check=False)


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
    # pushes; the producer keeps serving the others.
    D1 = consumer("D-dies")
    try:
        fetch(D1, list(range(64)), publish(P, "big", list(range(64))))
        D1.kill()
    finally:
        D1.close(check=False)
    fetch(D, [1, 2], publish(P, "after", [5, 6]))
    D.event("FETCH_DONE")
    assert D.cmd("verify 7 5,6 1,2", "VERIFY") == "VERIFY ok"
    P.event("RELEASED", req="after")
    assert P.p.poll() is None


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


CASES = [case_roundtrip, case_colon_id, case_tail, case_zero_blocks, case_expiry,
         case_unknown_id, case_out_of_range, case_version_mismatch, case_layout_mismatch,
         case_unreachable, case_killed_peer, case_restart, case_destroy_inflight, case_stalled_peer, case_killed_consumer,
         case_many]


def main():
    global MODE, MEM
    args = sys.argv[1:]
    if args[:1] == ["--mode"]:
        MODE = args[1]
        args = args[2:]
    MEM = ["--user-mem"] if MODE == "tcp" else []
    os.environ["UCX_TLS"] = {"tcp": "tcp,self", "sm": "sm,tcp,self"}[MODE]
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    cases = [c for c in CASES if not args or c.__name__[5:] in args]
    failed = 0
    for c in cases:
        t0 = time.monotonic()
        P = producer()
        D = consumer()
        try:
            c(P, D)
            P.close()
            D.close()
            print("ok   %-20s %.2fs" % (c.__name__[5:], time.monotonic() - t0), flush=True)
        except Exception as e:  # report and go on with the other cases
            failed += 1
            print("FAIL %-20s %s" % (c.__name__[5:], e), flush=True)
            for x in (P, D):
                try:
                    x.kill()
                    x.close(check=False)
                except Exception:
                    pass
    print("%d/%d passed (UCX_TLS=%s)" % (len(cases) - failed, len(cases), os.environ["UCX_TLS"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
