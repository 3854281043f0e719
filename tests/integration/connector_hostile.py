#!/usr/bin/env python3
"""Hostile-peer tests of libkvconnector over UCX on 127.0.0.1.

Replays what a hostile peer tries against a producer (kvc_testpeer) — with
the cluster secret (an authenticated but malicious engine) or without it —
and what a hostile producer does to a consumer, while legitimate transfers
run at the same time.  Each case asserts that the victim stays up, serves or
writes nothing it should not, and loses no legitimate transfer.  The hostile
side is kvc_hostile (tests/integration/kvc_hostile.c) or raw sockets here.

usage: connector_hostile.py --mode tcp|sm [case ...]
"""
import json
import os
import random
import socket
import subprocess
import sys
import time

from pdharness import connector as kvc

HOSTILE = os.path.join(os.environ.get("PX_BIN_DIR", "build/bin"), "kvc_hostile")
SECRET = "hostile-test-cluster-secret"


def hostile(*args, env=None, timeout=15):
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run([HOSTILE] + [str(a) for a in args], capture_output=True, text=True,
                       timeout=timeout, env=e)
    out = [l for l in r.stdout.splitlines() if not (l.startswith("[") and " UCX " in l)]
    assert r.returncode == 0 and out, "kvc_hostile %s: rc=%d\n%s\n%s" % (
        args, r.returncode, r.stdout, r.stderr[-2000:])
    return out[-1]


def stats(p):
    return {k: int(v) for k, v in p.stat().items()}


def long_fetch(P, D, req, n=48):
    """Starts a legitimate fetch of n blocks; returns a checker to call later."""
    remote = list(range(0, n))
    local = list(range(64 - n, 64))
    x = kvc.fetch(D, local, kvc.publish(P, req, remote))

    def check():
        D.event("FETCH_DONE", xfer=x)
        assert D.cmd("verify 7 %s %s" % (kvc.ids(remote), kvc.ids(local)), "VERIFY") == "VERIFY ok"
        P.event("RELEASED", req=req)
    return check


# ------------------------------------------------------------------ cases --

def case_auth(P, D):
    # Right secret: works, and both sides say they are authenticated.
    kvc.roundtrip(P, D, "auth-ok", [1, 2], [3, 4])
    assert stats(P)["authenticated"] == 1 and stats(D)["authenticated"] == 1
    # Wrong secret, no secret on the consumer, no secret on the producer:
    # KVC_ERR_AUTH on the consumer, counted on the producer, never a
    # version error; nothing written, nothing released.
    for name, env, who in (("D-wrong", {"KVC_SECRET": "not-the-secret"}, P),
                           ("D-none", {"KVC_SECRET": ""}, P)):
        E = kvc.consumer(name, env=env)
        try:
            before = stats(P)["auth_failed"]
            params = kvc.publish(P, "a-" + name, [5, 6])
            kvc.fetch(E, [5, 6], params)
            ev = E.event("FETCH_FAILED")
            assert "KVC_ERR_AUTH" in ev and "KVC_ERR_VERSION" not in ev, ev
            assert E.cmd("zero 5,6", "ZERO") == "ZERO yes"
            assert stats(P)["auth_failed"] == before + 1
            assert stats(P)["published_now"] >= 1  # not released
        finally:
            E.close()
    Q = kvc.producer("P-none", env={"KVC_SECRET": ""})
    try:
        assert stats(Q)["authenticated"] == 0
        kvc.fetch(D, [7], kvc.publish(Q, "a-open", [7]))
        ev = D.event("FETCH_FAILED")
        assert "KVC_ERR_AUTH" in ev and "no cluster secret" in ev, ev
        with open(Q.errpath) as f:
            assert "NOT authenticated" in f.read()  # warned once at start
    finally:
        Q.close()
    # Without a secret on both sides it still works (warned, authenticated=0).
    Q = kvc.producer("P-open", env={"KVC_SECRET": ""})
    E = kvc.consumer("D-open", env={"KVC_SECRET": ""})
    try:
        kvc.roundtrip(Q, E, "open", [8], [8])
        assert stats(E)["authenticated"] == 0
    finally:
        Q.close()
        E.close()
    kvc.roundtrip(P, D, "auth-after", [9], [9])


def case_invented_id(P, D):
    check = long_fetch(P, D, "legit-1")
    real = json.loads(kvc.publish(P, "real", [10, 11]))
    # kvc_hostile: a pull for an id never published, with a real token.
    out = hostile("consumer", P.port, "pull", "never-published", real["remote_kv_token"],
                  "10:0:2")
    assert out.startswith("PULL data=0 refused=KVC_ERR_DENIED "), out
    # The library as the attacker: a fetch with an invented id.
    bad = dict(real, remote_request_id="invented-id")
    x = kvc.fetch(D, [2, 3], json.dumps(bad))
    if kvc.MODE == "tcp":  # push: the producer refuses
        ev = D.event("FETCH_FAILED", xfer=x)
        assert "KVC_ERR_DENIED" in ev, ev
        assert D.cmd("zero 2,3", "ZERO") == "ZERO yes"
    else:  # one-sided read of shared memory: the producer is not asked (SECURITY.md)
        D.event(("FETCH_DONE", "FETCH_FAILED"), xfer=x)
    check()
    st = stats(P)
    assert st["denied"] >= 1 and st["published_now"] == 1, st  # "real" still there


def case_wrong_token(P, D):
    check = long_fetch(P, D, "legit-2")
    real = json.loads(kvc.publish(P, "tok", [12, 13]))
    wrong = ("0" if real["remote_kv_token"][0] != "0" else "1") + real["remote_kv_token"][1:]
    out = hostile("consumer", P.port, "pull", "tok", wrong, "12:0:2")
    assert out.startswith("PULL data=0 refused=KVC_ERR_DENIED "), out
    # A notification with a wrong token frees nothing.
    before = stats(P)
    assert hostile("consumer", P.port, "notify", "tok", wrong, 1) == "NOTIFY sent"
    deadline = time.monotonic() + 5
    while stats(P)["denied"] < before["denied"] + 1:
        assert time.monotonic() < deadline, "wrong-token notification not counted"
        kvc.pump([P], 0.05)
    st = stats(P)
    assert st["released"] == before["released"] and st["published_now"] >= 1, st
    assert not any("RELEASED" in e and "req=tok " in e for e in P.events)
    # The right token still works afterwards: the real consumer is not hurt.
    x = kvc.fetch(D, [6, 7], json.dumps(real))
    D.event("FETCH_DONE", xfer=x)
    assert D.cmd("verify 7 12,13 6,7", "VERIFY") == "VERIFY ok"
    P.event("RELEASED", req="tok")
    check()


def case_pull_beyond(P, D):
    # A valid token may not stretch to blocks outside its publication, nor to
    # the whole cache: the pull is refused as a whole.
    real = json.loads(kvc.publish(P, "small", [14, 15]))
    tok = real["remote_kv_token"]
    for runs in ("14:0:3", "0:0:64", "14:0:2,14:2:2", "13:0:1"):
        out = hostile("consumer", P.port, "pull", "small", tok, runs)
        assert out.startswith("PULL data=0 refused=KVC_ERR_DENIED "), (runs, out)
    out = hostile("consumer", P.port, "pull", "small", tok, "14:0:2")
    # the legitimate part: 1 message per region; a push consumer gets no rkeys
    assert out == "PULL data=2 refused=none refusals=0 ends=1 rkeys=0", out
    # The same pull repeated 20 times: served a bounded number of times (8
    # pulls per publication in all), then refused.
    out = hostile("consumer", P.port, "pull", "small", tok, "14:0:2", 20)
    assert out == "PULL data=14 refused=KVC_ERR_DENIED refusals=13 ends=7 rkeys=0", out
    kvc.roundtrip(P, D, "after-beyond", [16], [16])


def case_put(P, D):
    # An authenticated peer that asks for one-sided reads gets rkeys.  Over
    # tcp it can neither write the producer's memory nor read a block that is
    # not published (UCX's emulated RMA is off).  On shared memory the pool
    # mapping UCX hands out is readable and writable: the documented limit
    # (SECURITY.md), asserted here so that a change is noticed.
    check = long_fetch(P, D, "legit-3")
    out = hostile("consumer", P.port, "put", 0, 5)
    get = hostile("consumer", P.port, "get", 1, 50)
    assert P.p.poll() is None
    intact = P.cmd("verify 7 5 5", "VERIFY") == "VERIFY ok"
    if kvc.MODE == "tcp":
        assert intact, "producer block overwritten: " + out
        assert "status=Success" not in out and "status=Success" not in get, (out, get)
    else:
        assert not intact and "status=Success" in out, out
        P.cmd("fill 7", "OK")
    check()
    # Without the secret there is no handshake, hence no key at all.
    r = subprocess.run([HOSTILE, "consumer", str(P.port), "put", "0", "5"], capture_output=True,
                       text=True, timeout=15, env=dict(os.environ, KVC_SECRET="wrong"))
    assert "ERR refused by the producer" in r.stdout, r.stdout
    assert P.cmd("verify 7 5 5", "VERIFY") == "VERIFY ok"
    print("  %s: %s | %s" % (kvc.MODE, out, get), flush=True)


def case_mutated_hello(P, D):
    # 1000 HELLOs (and AUTHs) with bytes changed, appended or cut: the
    # producer closes each bad one, stays up and keeps serving.
    rnd = random.Random(12)
    base = kvc.hdr(kvc.WIRE, 1, 0)
    check = long_fetch(P, D, "legit-4")
    for i in range(1000):
        body = bytearray(kvc.hello_body("D-mut", 1, bytes(rnd.getrandbits(8) for _ in range(32))))
        msg = bytearray(kvc.hdr(kvc.WIRE, 1, len(body)) + body)
        k = rnd.randrange(4)
        if k == 0:
            for _ in range(rnd.randrange(1, 4)):
                msg[rnd.randrange(len(msg))] ^= 1 << rnd.randrange(8)
        elif k == 1:
            msg = msg[:rnd.randrange(len(msg))]
        elif k == 2:
            msg += bytes(rnd.getrandbits(8) for _ in range(rnd.randrange(1, 64)))
        s = socket.create_connection(("127.0.0.1", P.port), timeout=5)
        try:
            s.sendall(bytes(msg))
            if k != 3:
                s.shutdown(socket.SHUT_WR)  # nothing more comes
            else:
                # A valid HELLO, then an AUTH with a random MAC.
                got = b""
                while len(got) < 12:
                    c = s.recv(4096)
                    if not c:
                        break
                    got += c
                if got[:4] == kvc.MAGIC and int.from_bytes(got[6:8], "little") == 3:
                    s.sendall(kvc.hdr(kvc.WIRE, 4, 33) + bytes([2]) + os.urandom(32))
            s.settimeout(5)
            while s.recv(65536):  # until the producer closes
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        finally:
            s.close()
        if i % 250 == 249:
            assert P.p.poll() is None
            kvc.roundtrip(P, D, "mut-%d" % i, [i % 16], [i % 16])
    check()
    st = stats(P)
    assert st["auth_failed"] >= 1 and st["peer_errors"] >= 100, st
    assert st["expired"] == 0 and st["published_now"] == 0, st


def case_slow_handshakes(P, D):
    # 300 connections that never finish a HELLO (more than the 256 handshake
    # slots): a new consumer still handshakes at once, the old ones go on.
    K = kvc.producer("P-slow", "--connect-timeout-ms", "20000")
    socks = []
    try:
        kvc.roundtrip(K, D, "slow-warm", [1], [1])
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", K.port), timeout=5)
            if i % 2:
                s.sendall(kvc.hdr(kvc.WIRE, 1, 40)[:5])  # a header begun, never finished
            socks.append(s)
        E = kvc.consumer("D-new")
        try:
            t0 = time.monotonic()
            kvc.roundtrip(K, E, "slow-new", [2, 3], [2, 3])
            assert time.monotonic() - t0 < 5
        finally:
            E.close()
        kvc.roundtrip(K, D, "slow-old", [4], [4])
        assert stats(K)["peer_errors"] >= 300 - 64
    finally:
        for s in socks:
            s.close()
        K.close()


def hostile_producer(mode):
    p = subprocess.Popen([HOSTILE, "producer", mode, "2", "64", "4096", "7"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    line = p.stdout.readline()
    assert line.startswith("READY port="), line + p.stderr.read()
    return p, int(line.split("=")[1])


def evil_params(port, req, remote):
    return json.dumps({"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_block_ids": remote, "remote_engine_id": "P-hostile",
                       "remote_request_id": req, "remote_host": "127.0.0.1",
                       "remote_port": port, "tp_size": 1,
                       "remote_kv_token": "00112233445566778899aabbccddeeff"})


def case_hostile_producer(P, D):
    # A producer that pushes wrongly: the consumer fails the fetch with a
    # clear status, writes nothing it did not ask for, and a legitimate fetch
    # from another producer at the same time is unaffected.
    E = kvc.Peer("D-victim", "--regions", "2", "--blocks", "64", "--block-len", "4096",
                 "--xfer-timeout-ms", "1500", *kvc.MEM)
    E.cmd("clear", "OK")
    try:
        want = {"ok": "FETCH_DONE", "dup": "sent twice", "outside": "outside the requested",
                "short": "short transfer", "stray": "KVC_ERR_TIMED_OUT",
                # device memory announced: pushed, never read as host memory
                "cudamem": "FETCH_DONE",
                # a memory type this consumer does not know: refused at the handshake
                "memtype": "KVC_ERR_INCOMPATIBLE"}
        for mode, expect in want.items():
            hp, port = hostile_producer(mode)
            try:
                check = long_fetch(P, D, "legit-hp-" + mode, n=32)
                kvc.fetch(E, [1, 2, 3], evil_params(port, "r-" + mode, [1, 2, 3]))
                ev = E.event(("FETCH_DONE", "FETCH_FAILED"), timeout=10)
                assert expect in ev, (mode, ev)
                if mode in ("ok", "cudamem"):
                    assert E.cmd("verify 7 1,2,3 1,2,3", "VERIFY") == "VERIFY ok"
                else:
                    assert "FETCH_FAILED" in ev and "status=KVC_ERR_" in ev, ev
                # Blocks nobody asked for stay untouched, whatever was pushed.
                assert E.cmd("zero %s" % kvc.ids(range(4, 64)), "ZERO") == "ZERO yes", mode
                if mode == "stray":  # nothing with a wrong token was written
                    assert E.cmd("zero 1,2,3", "ZERO") == "ZERO yes"
                check()
            finally:
                hp.stdin.close()
                hp.wait(timeout=10)
            E.cmd("clear", "OK")
        st = stats(E)
        assert st["fetch_done"] == 2 and st["fetch_failed"] == 5, st
    finally:
        E.close()


CASES = [case_auth, case_invented_id, case_wrong_token, case_pull_beyond, case_put,
         case_mutated_hello, case_slow_handshakes, case_hostile_producer]


def main():
    args = kvc.set_mode(sys.argv[1:])
    os.environ["KVC_SECRET"] = SECRET
    os.environ.pop("KVC_SECRET_FILE", None)
    return kvc.run_cases(CASES, args, check_alive=True)


if __name__ == "__main__":
    sys.exit(main())
