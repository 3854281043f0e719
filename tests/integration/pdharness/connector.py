# SPDX-License-Identifier: Apache-2.0
"""The connector's test peers: kvc_testpeer processes (line protocol, see
tests/integration/connector_peer.c) driven from Python, and the side
channel's wire format for hostile clients.

* ``set_mode(argv)``: --mode tcp|sm: UCX_TLS and the producers' memory.
* ``Peer``, ``producer``, ``consumer``: peers started and ready; every wait
  is a bounded read of the peer's stdout (``pump``, ``Peer.expect``,
  ``Peer.event``); nothing sleeps to wait for a server.
* ``publish``, ``fetch``, ``roundtrip``: a transfer and its verification.
* ``run_cases``: each case function with a fresh producer and consumer, one
  ok/FAIL line a case."""

import os
import select
import subprocess
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

    def take_events(self):
        """Files the complete lines already read; only events may be pending."""
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            line = line.decode()
            if line.startswith("[") and " UCX " in line:
                continue
            if not line.startswith("EVENT "):
                raise AssertionError("%s: unexpected %r" % (self.engine, line))
            self.events.append(line)

    def count(self, kind):
        return sum(1 for e in self.events if e.split()[1] == kind)

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


def pump(peers, timeout):
    """Reads whatever the peers have written (waiting up to `timeout` for the
    first byte) into their buffers and files complete EVENT lines, so that no
    peer ever blocks on a full stdout while the test waits on another one."""
    r, _, _ = select.select([x.p.stdout for x in peers], [], [], max(timeout, 0))
    for x in peers:
        if x.p.stdout in r:
            chunk = os.read(x.p.stdout.fileno(), 1 << 20)
            if not chunk:
                raise AssertionError("%s: exited rc=%s; stderr:\n%s"
                                     % (x.engine, x.p.poll(), x.stderr()))
            x.buf += chunk
        x.take_events()


def pipelined(peer, cmds, prefix, others=(), batch=32):
    """Sends `cmds` `batch` at a time (a batch of answers fits a pipe), returns
    the answer lines in order; keeps `others` drained meanwhile."""
    out = []
    for i in range(0, len(cmds), batch):
        peer.send("\n".join(cmds[i:i + batch]))
        for _ in cmds[i:i + batch]:
            out.append(peer.expect(prefix))
        if others:
            pump(others, 0)
    return out


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


def roundtrip(K, C, req, remote, local, seed=7):
    x = fetch(C, local, publish(K, req, remote))
    C.event("FETCH_DONE", xfer=x)
    assert C.cmd("verify %d %s %s" % (seed, ids(remote), ids(local)), "VERIFY") == "VERIFY ok"
    K.event("RELEASED", req=req)

def set_mode(argv):
    """Takes --mode tcp|sm off the front of argv (default tcp): sets MODE,
    MEM and UCX_TLS; returns the rest of argv."""
    global MODE, MEM
    args = list(argv)
    if args[:1] == ["--mode"]:
        MODE = args[1]
        args = args[2:]
    MEM = ["--user-mem"] if MODE == "tcp" else []
    os.environ["UCX_TLS"] = {"tcp": "tcp,self", "sm": "sm,tcp,self"}[MODE]
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    return args


def run_cases(cases, args, check_alive=False):
    """Runs the cases named in args (all when none), each as case(P, D) with a
    fresh producer P and consumer D; with check_alive both must still run
    when the case returns. Returns the exit status."""
    cases = [c for c in cases if not args or c.__name__[5:] in args]
    failed = 0
    for c in cases:
        t0 = time.monotonic()
        P = producer()
        D = consumer()
        try:
            c(P, D)
            if check_alive:
                assert P.p.poll() is None and D.p.poll() is None
            P.close()
            D.close()
            print("ok   %-20s %.2fs" % (c.__name__[5:], time.monotonic() - t0), flush=True)
        except Exception as e:  # report and go on with the other cases
            if os.environ.get("KVC_TEST_TRACE"):
                import traceback
                traceback.print_exc()
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


# Side-channel wire format (connector/wire.c): u32 magic "KVCH", u16 version,
# u16 type (1 HELLO), u32 body length; HELLO body: str16 engine id, u8 flags,
# 32-byte nonce.
MAGIC = b"KVCH"
WIRE = 4


def hdr(version, typ, body_len):
    return MAGIC + version.to_bytes(2, "little") + typ.to_bytes(2, "little") + \
        body_len.to_bytes(4, "little")


def hello_body(engine, flags=1, nonce=b"\x00" * 32):
    e = engine.encode()
    return len(e).to_bytes(2, "little") + e + bytes([flags]) + nonce
