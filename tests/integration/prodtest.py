"""prodtest: small helpers for the production-feature tests (issue 5) on top
of pxtest (Python 3 stdlib only).

* ``ProdCase``: PxTestCase whose pdproxy starts with ``--drain-delay 0`` and
  ``--health-interval 0`` unless the test passes its own values, plus helpers
  to read pdproxy's /metrics with labels, poll a backend's health gauge, and
  send many requests concurrently.
* ``HostMock``: a pxtest MockBackend bound to any loopback address
  (127.0.0.2, 127.0.0.3, ...) and, optionally, a given port.
* ``prom()``: a Prometheus text page parsed into (name, labels, value).

Every loop is bounded by a deadline and a count."""

import json
import os
import re
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pxtest  # noqa: E402
from pxtest import HOST, MAX_LOOP, MockBackend, PxTestCase, Respond, http_request, now  # noqa: E402

_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prom(text):
    """[(name, {label: value}, float)] for every sample line."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels_txt, value = rest.rsplit("}", 1)
            labels = {k: v for k, v in _LABEL_RE.findall(labels_txt)}
        else:
            name, value = line.split(None, 1)
            labels = {}
        out.append((name, labels, float(value.split()[0])))
    return out


def prom(port, path="/metrics"):
    r = http_request(port, "GET", path)
    if r.status != 200:
        raise AssertionError("GET %s on %d answered %s: %r" % (path, port, r.status, r.body[:200]))
    return parse_prom(r.body.decode("utf-8", "replace"))


def metric(samples, name, **labels):
    """Sum of the samples called `name` whose labels include `labels`
    (None when there is none)."""
    vals = [v for n, l, v in samples
            if n == name and all(l.get(k) == str(x) for k, x in labels.items())]
    return sum(vals) if vals else None


class HostMock(MockBackend):
    """MockBackend listening on `host` (any 127.x address) and `port` (0: any)."""

    def __init__(self, handler=None, name="mock", host="127.0.0.2", port=0):
        self.bind_host = host
        saved = pxtest.HOST
        # MockBackend binds to pxtest.HOST in its constructor: point it at our
        # address for that moment only (tests here are single-threaded while
        # they build their mocks).
        pxtest.HOST = host
        try:
            super().__init__(handler, name=name, port=port)
        finally:
            pxtest.HOST = saved

    @property
    def addr(self):
        return (self.bind_host, self.port)


def engine_metrics_handler(state):
    """A probe handler for a mock engine: GET /health answers state['health']
    (status), GET /metrics reports state['waiting'] / state['running'] in
    vLLM's metric names."""

    def h(req):
        if req.path.startswith("/metrics"):
            body = ("# TYPE vllm:num_requests_waiting gauge\n"
                    "vllm:num_requests_waiting{model_name=\"m\"} %d\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    "vllm:num_requests_running{model_name=\"m\"} %d\n"
                    "vllm:kv_cache_usage_perc{model_name=\"m\"} %s\n"
                    % (state.get("waiting", 0), state.get("running", 0), state.get("kv", 0)))
            return Respond(200, [("Content-Type", "text/plain; version=0.0.4")], body.encode())
        st = state.get("health", 200)
        return Respond(st, [("Content-Type", "application/json")], b"{}")

    return h


def request_ids(mock):
    return [r.header("x-request-id") for r in list(mock.requests)]


class ProdCase(PxTestCase):
    """PxTestCase with defaults fit for these tests."""

    def start(self, prefill=(), decode=(), extra=(), env=None, threads=2, args=None,
              health_interval="0", drain_delay="0"):
        extra = list(extra)
        if "--health-interval" not in extra and health_interval is not None:
            extra += ["--health-interval", str(health_interval)]
        if "--drain-delay" not in extra and drain_delay is not None:
            extra += ["--drain-delay", str(drain_delay)]
        if args is not None:
            args = list(args) + extra
        return self.start_proxy(prefill, decode, extra, env=env, threads=threads, args=args)

    @staticmethod
    def bname(m):
        """A mock's backend name in pdproxy's logs and metrics."""
        host = getattr(m, "bind_host", HOST)
        return "%s:%d" % (host, m.port)

    def up(self, px, role, mock):
        return metric(prom(px.port), "pdproxy_backend_up", role=role, backend=self.bname(mock))

    def wait_up(self, px, role, mock, want, timeout):
        """Poll pdproxy_backend_up until it equals `want`; returns the time it did."""
        deadline = now() + timeout
        last = None
        for _ in range(MAX_LOOP):
            last = self.up(px, role, mock)
            if last == want:
                return now()
            if now() >= deadline:
                break
            time.sleep(0.02)
        self.fail("pdproxy_backend_up{role=%s,backend=%s} stayed %r, wanted %r after %.1fs"
                  % (role, self.bname(mock), last, want, timeout))

    def post(self, px, body=None, path="/v1/completions", headers=None, timeout=10.0):
        return http_request(px.port, "POST", path, body or pxtest.completion_body(),
                            headers=headers, timeout=timeout)

    def concurrent(self, fn, n, workers=None, timeout=30.0):
        """Runs fn(i) for i in range(n) on `workers` threads (default n);
        returns the results in order (an exception is returned as it is)."""
        results = [None] * n
        idx = list(range(n))
        lock = threading.Lock()

        def run():
            for _ in range(n):
                with lock:
                    if not idx:
                        return
                    i = idx.pop(0)
                try:
                    results[i] = fn(i)
                except Exception as e:  # reported by the caller
                    results[i] = e

        ts = [threading.Thread(target=run, daemon=True) for _ in range(workers or n)]
        for t in ts:
            t.start()
        deadline = now() + timeout
        for t in ts:
            t.join(max(0.0, deadline - now()))
        self.assertFalse(any(t.is_alive() for t in ts), "client threads still running after %.0fs"
                         % timeout)
        return results


def errmsg(resp):
    try:
        return json.loads(bytes(resp.body))["error"]["message"]
    except Exception:
        return repr(bytes(resp.body)[:300])


def connect_refused(port, host=HOST, timeout=1.0):
    """True when connect() to host:port is refused right now."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        s.close()
