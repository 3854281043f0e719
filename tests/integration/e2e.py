"""Harness for end-to-end tests: real engine-sim and pdproxy processes on
127.0.0.1, the connector moving KV blocks over UCX on loopback.

Python 3 standard library only. Every wait is bounded; readiness is polled."""
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import unittest

HOST = "127.0.0.1"
BIN = os.environ.get("PX_BIN_DIR") or os.path.join(
    os.path.dirname(__file__), "..", "..", "build", "bin")
PDPROXY = os.path.join(BIN, "pdproxy")
ENGINE_SIM = os.path.join(BIN, "engine-sim")


def free_port():
    s = socket.socket()
    s.bind((HOST, 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Proc:
    """A child process with its stderr in a file; stop() reaps it."""

    def __init__(self, name, argv, env=None):
        self.name = name
        fd, self.log_path = tempfile.mkstemp(prefix=name + "-", suffix=".log")
        os.close(fd)
        e = dict(os.environ)
        e.setdefault("UCX_TLS", "tcp,self")
        e.update(env or {})
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=e)

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self, timeout=10):
        """SIGTERM and wait; returns the exit status (SIGKILL after timeout)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def wait_http(port, path="/health", timeout=15.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError("%s exited early:\n%s" % (proc.name, proc.log()))
        try:
            c = http.client.HTTPConnection(HOST, port, timeout=1)
            c.request("GET", path)
            r = c.getresponse()
            r.read()
            c.close()
            if r.status == 200:
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError("port %d not ready after %.0fs" % (port, timeout))


def engine(role, extra=(), env=None):
    port = free_port()
    p = Proc("engine-sim-%s-%d" % (role, port),
             [ENGINE_SIM, "--role", role, "--port", str(port), "--num-blocks", "4096",
              "--layers", "2", "--block-bytes", "4096"] + list(extra), env=env)
    p.port = port
    wait_http(port, proc=p)
    return p


def proxy(prefills, decodes, extra=()):
    port = free_port()
    argv = [PDPROXY, "--port", str(port), "--threads", "2", "--drain-delay", "0",
            "--prefiller-hosts"] + [HOST] * len(prefills) + ["--prefiller-ports"] + \
        [str(p) for p in prefills] + ["--decoder-hosts"] + [HOST] * len(decodes) + \
        ["--decoder-ports"] + [str(d) for d in decodes] + list(extra)
    p = Proc("pdproxy-%d" % port, argv)
    p.port = port
    wait_http(port, "/healthcheck", proc=p)
    return p


def metrics(port):
    """Parses a Prometheus text page into {name: value} (labels dropped)."""
    c = http.client.HTTPConnection(HOST, port, timeout=5)
    c.request("GET", "/metrics")
    r = c.getresponse()
    text = r.read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        out[name.split("{", 1)[0]] = float(value)
    return out


def post(port, path, body, stream=False, timeout=60, headers=None):
    """POSTs JSON; returns (status, headers, text) where text is the generated
    text assembled from SSE events or the JSON answer."""
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request("POST", path, body=json.dumps(body), headers=h)
    r = c.getresponse()
    raw = r.read()
    c.close()
    return r.status, dict(r.getheaders()), raw


def answer_text(path, raw, stream):
    """The generated text of a completion answer (JSON or SSE bytes)."""
    chat = path.endswith("/chat/completions")
    if not stream:
        doc = json.loads(raw)
        ch = doc["choices"][0]
        return ch["message"]["content"] if chat else ch["text"]
    text = []
    done = False
    for line in raw.decode().split("\n"):
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        ev = json.loads(data)
        for ch in ev["choices"]:
            text.append(ch["delta"].get("content", "") if chat else ch.get("text", ""))
    if not done:
        raise AssertionError("SSE stream without data: [DONE]")
    return "".join(text)


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        ok, last = pred()
        if ok:
            return last
        time.sleep(0.05)
    raise AssertionError("timed out waiting for %s (last: %r)" % (what, last))


class ClusterCase(unittest.TestCase):
    """Tracks processes; after each test stops them and requires a clean exit
    (status 0: under ASan a leak or an error report fails the test)."""

    def setUp(self):
        self.procs = []

    def start(self, p):
        self.procs.append(p)
        return p

    def tearDown(self):
        bad = []
        for p in reversed(self.procs):
            killed = p.proc.returncode is not None and p.proc.returncode < 0
            rc = p.stop()
            if not killed and rc != 0:
                bad.append("%s exited with status %s" % (p.name, rc))
        if bad or not getattr(self._outcome, "success", True):
            for p in self.procs:
                print("----- %s (last lines)\n%s" % (p.name, "\n".join(p.log().splitlines()[-25:])))
        for p in self.procs:
            try:
                os.unlink(p.log_path)
            except OSError:
                pass
        self.assertEqual(bad, [], "processes must exit cleanly")
