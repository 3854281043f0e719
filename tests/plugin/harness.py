# SPDX-License-Identifier: Apache-2.0
"""Processes for the plugin tests: engine_server.py pairs on 127.0.0.1.

The tests need torch: run under an interpreter that has it (the python3 on
PATH may be a pyenv one without; /usr/bin/python3 has Debian's torch), else
exit 77 (ctest SKIP_RETURN_CODE)."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The integration tests' harness: its bounded waits serve here too.
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from pdharness.net import wait_until, wait_value  # noqa: E402
BUILD = os.environ.get("PX_BUILD_DIR", os.path.join(ROOT, "build"))
SKIP = 77


def need_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        alt = "/usr/bin/python3"
        if os.path.exists(alt) and os.path.realpath(sys.executable) != os.path.realpath(alt) \
                and not os.environ.get("PDKV_REEXEC"):
            os.environ["PDKV_REEXEC"] = "1"
            os.execv(alt, [alt] + sys.argv)
        print("SKIP: torch is not installed for %s" % sys.executable)
        sys.exit(SKIP)


def free_ports(n):
    """n consecutive free TCP ports (side channels: base + TP rank)."""
    for _ in range(200):
        base = random.randint(20000, 60000)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def lib_env(extra=None):
    env = dict(os.environ)
    env["PDKV_LIBRARY"] = os.path.join(BUILD, "connector", "libkvconnector.so")
    env.setdefault("KVC_SECRET", "plugin-test-secret")
    env.setdefault("KVC_LOG_LEVEL", "error")
    env.update(extra or {})
    return env


class Engine:
    """engine_server.py as a subprocess."""

    def __init__(self, name, tp=1, env=None, args=()):
        self.name = name
        for attempt in range(3):  # a port taken between the probe and the bind: again
            try:
                self._start(tp, env, args)
                return
            except RuntimeError:
                if attempt == 2:
                    raise

    def _start(self, tp, env, args):
        name = self.name
        self.port = free_ports(1)
        self.kv_port = free_ports(tp)
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                     "pdkv-%s-%d.log" % (name, self.port)), "w+")
        cmd = [sys.executable, os.path.join(HERE, "engine_server.py"), "--port", str(self.port),
               "--kv-port", str(self.kv_port), "--engine-id", name, "--tp", str(tp)] + list(args)
        self.proc = subprocess.Popen(cmd, env=lib_env(env), stdout=self.log, stderr=self.log)
        def up():
            try:
                return self.get("/health")[0] == 200
            except OSError:
                return False

        # Up, or exited: either ends the wait.
        if not wait_until(lambda: self.proc.poll() is not None or up(), 30, 0.1) or not up():
            self.kill()
            raise RuntimeError("%s did not start:\n%s" % (name, self.output()))

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def call(self, method, path, body=None, headers=None, timeout=60):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request("http://127.0.0.1:%d%s" % (self.port, path), data=data,
                                     method=method, headers=dict(headers or {}))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def get(self, path):
        return self.call("GET", path, timeout=10)

    def metric(self, name):
        """A sample's value from GET /metrics (0.0 if absent)."""
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.port, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + "{") or line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def state(self):
        return self.get("/test/state")[1]

    def wait_state(self, pred, timeout=20):
        return wait_value(self.state, pred, timeout, 0.05)

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        self.kill(signal.SIGTERM)
        self.log.close()


def prefill(p, prompt, rid):
    st, r = p.call("POST", "/v1/completions",
                   {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
                   headers={"X-Request-Id": rid})
    assert st == 200, (st, r)
    return r["kv_transfer_params"], r["choices"][0]["text"]


def decode(d, prompt, kv, rid, max_tokens=3):
    return d.call("POST", "/v1/completions",
                  {"prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": kv},
                  headers={"X-Request-Id": rid})


def prompt_of(i, n=None):
    n = n if n is not None else 8 + (i * 37) % 90
    return ("request %d says " % i + "lorem ipsum dolor sit amet " * 8)[:n]
