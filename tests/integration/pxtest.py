"""pxtest: harness for pdproxy's integration tests (Python 3 stdlib only).

What it gives a test:

* ``Proxy``: pdproxy as a real subprocess on a free 127.0.0.1 port, started with
  explicit flags and a clean environment (no inherited OPENAI_API_KEY or
  PDPROXY_*), readiness by polling connect(), then a check that no other
  process shares the port (pdproxy listens with SO_REUSEPORT); stderr
  captured to a file and printed when the test fails; stopped with SIGINT
  (SIGKILL after 2 s) and reaped by the test's cleanup, which also fails the
  test if pdproxy died during it or a sanitizer reported anything.
* ``MockBackend``: a raw-socket HTTP/1.1 server standing in for a prefill or
  decode engine. One thread per connection, keep-alive, chunked request bodies,
  ``Expect: 100-continue``. It records every request (method, path, headers as a
  list with duplicates, raw body bytes, connection id, arrival time) and
  answers through a per-test handler returning an action (``Respond``,
  ``Stream``, ``Reset``, ``CloseBeforeHeaders``, ``Hang``). Each connection
  records when the peer (pdproxy) closed it, so a test can assert that the
  proxy cancelled upstream work, and how many response bytes the mock has
  written (backpressure). pdproxy's own probes (GET /health, GET /metrics)
  are answered by the mock itself and kept apart in ``.probes``.
* ``Blackhole``: a listener whose accept queue is full, so that SYNs to it are
  dropped and a connect() times out (Linux drops SYNs to a listener whose
  accept queue is full when tcp_abort_on_overflow=0). ``Blackhole.works``
  says whether a probe connect really timed out; tests skip otherwise.
* ``RawClient``: a socket-level HTTP/1.1 client that reads responses
  incrementally with timestamps, decodes chunked encoding byte-exactly and
  strictly, and reports whether a chunked body ended with its terminating
  0-chunk or the connection was closed before it.
* ``http_request``: ``http.client`` for ordinary cases.
* ``PxTestCase``: unittest base class wiring the above together and cleaning up.

With ``PX_MOCK_TLS=1`` in the environment every mock backend speaks HTTPS
(a throw-away CA made with the openssl CLI) and ``proxy_args`` names them as
``https://`` URLs with ``--upstream-ca``: the same upstream tests then run
through pdproxy's https transport instead of its own http client.

Every loop here is bounded by a deadline and an iteration count.
"""

import http.client
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HOST = "127.0.0.1"
MOCK_TLS = os.environ.get("PX_MOCK_TLS") == "1"
try:
    from ssl import SSLError as _SSLError
except ImportError:  # no ssl module: PX_MOCK_TLS cannot be used anyway
    class _SSLError(OSError):
        pass
_TLS = {}


def mock_tls():
    """(server SSLContext, CA file) for PX_MOCK_TLS, made once per process."""
    if "ctx" not in _TLS:
        import atexit
        import shutil
        import ssl
        d = tempfile.mkdtemp(prefix="pxtest-tls-")
        atexit.register(shutil.rmtree, d, True)

        def run(args):
            subprocess.run(["openssl"] + args, cwd=d, check=True, capture_output=True,
                           timeout=60)
        run(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=pxtest throw-away CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
        with open(os.path.join(d, "leaf.ext"), "w") as f:
            f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        run(["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=127.0.0.1"])
        run(["x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-out", "leaf.pem", "-extfile", "leaf.ext"])
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(os.path.join(d, "leaf.pem"), os.path.join(d, "leaf.key"))
        _TLS["ctx"], _TLS["ca"] = ctx, os.path.join(d, "ca.pem")
    return _TLS["ctx"], _TLS["ca"]
BIN_DIR = os.environ.get("PX_BIN_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "bin")
PDPROXY = os.path.join(BIN_DIR, "pdproxy")

UUID4_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")

# The kv_transfer_params pdproxy must put in every prefill request (DESIGN.md §1.1).
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Generous but finite bounds, so a hung proxy fails a test instead of hanging it.
IO_TIMEOUT = 10.0
MAX_LOOP = 1_000_000


def now():
    return time.monotonic()


def free_port():
    """A port that was free a moment ago on 127.0.0.1."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((HOST, 0))
        return s.getsockname()[1]
    finally:
        s.close()


def closed_port():
    """A port with no listener (connect() is refused)."""
    return free_port()


class DuplicateKeyError(ValueError):
    pass


def _no_dup_pairs(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise DuplicateKeyError("duplicate JSON key %r" % k)
        d[k] = v
    return d


def strict_json(data):
    """Parse JSON bytes/str; integers stay exact (Python ints), duplicate keys
    are an error, NaN/Infinity are an error."""
    if isinstance(data, (bytes, bytearray)):
        data = bytes(data).decode("utf-8")

    def bad_const(c):
        raise ValueError("non-standard JSON constant %s" % c)

    return json.loads(data, object_pairs_hook=_no_dup_pairs, parse_constant=bad_const)


def hdr_get(headers, name):
    """First value of header `name` (case-insensitive) in a list of pairs, or None."""
    name = name.lower()
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def hdr_all(headers, name):
    name = name.lower()
    return [v for k, v in headers if k.lower() == name]


def sanitized(pid):
    """Whether process `pid` runs with AddressSanitizer."""
    try:
        with open("/proc/%d/maps" % pid) as f:
            return "libasan" in f.read()
    except OSError:
        return False


def slack(pid):
    """How much longer than usual a bound on a latency may be for process
    `pid`: three times under AddressSanitizer, which slows every request
    and runs beside other tests. The bounds are there to catch a hang or a
    stall behind other clients, not to measure speed."""
    return 3.0 if sanitized(pid) else 1.0


def wait_until(pred, timeout, interval=0.005):
    """Poll pred() until true or timeout; returns the last value of pred()."""
    deadline = now() + timeout
    for _ in range(MAX_LOOP):
        v = pred()
        if v or now() >= deadline:
            return v
        time.sleep(interval)
    return pred()


# --------------------------------------------------------------------------
# pdproxy subprocess


class ProxyStartError(Exception):
    pass


class Proxy:
    """pdproxy running as a subprocess. Use PxTestCase.start_proxy()."""

    def __init__(self, args, env=None, port=None, ready_timeout=5.0, log_dir=None):
        self.args = list(args)
        self.port = port
        self.extra_env = dict(env or {})
        self.ready_timeout = ready_timeout
        self.proc = None
        self.ready_after = None  # seconds from spawn to first successful connect
        fd, self.stderr_path = tempfile.mkstemp(prefix="pdproxy-", suffix=".stderr", dir=log_dir)
        os.close(fd)
        self.stdout_path = self.stderr_path[:-len(".stderr")] + ".stdout"
        self._expected_exit = False

    @staticmethod
    def clean_env(extra=None):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("PDPROXY_") and k != "OPENAI_API_KEY"}
        env.update(extra or {})
        return env

    def spawn(self):
        cmd = [PDPROXY] + self.args
        with open(self.stderr_path, "wb") as err, open(self.stdout_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env=self.clean_env(self.extra_env))
        self.t_spawn = now()
        return self

    def wait_ready(self):
        """Poll connect() until the port accepts, the process exits, or timeout."""
        deadline = self.t_spawn + self.ready_timeout
        for _ in range(MAX_LOOP):
            if self.proc.poll() is not None:
                raise ProxyStartError("pdproxy exited with %s before listening; stderr:\n%s"
                                      % (self.proc.returncode, self.stderr()))
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(0.5)
            try:
                s.connect((HOST, self.port))
                self.ready_after = now() - self.t_spawn
                return self
            except OSError:
                pass
            finally:
                s.close()
            if now() >= deadline:
                break
            time.sleep(0.005)
        raise ProxyStartError("pdproxy not listening on %d after %.1fs; stderr:\n%s"
                              % (self.port, self.ready_timeout, self.stderr()))

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def owns_port(self, timeout=1.0):
        """True when every socket listening on our port belongs to this pdproxy.

        pdproxy listens with SO_REUSEPORT, so a second process that picked the
        same "free" port (another test running in parallel) would silently
        share it and take some of our connections."""
        def check():
            listeners = listening_inodes(self.port)
            mine = socket_inodes(self.proc.pid)
            return bool(listeners) and bool(listeners & mine) and listeners <= mine
        return bool(wait_until(check, timeout, 0.01))

    def stderr(self):
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def stdout(self):
        try:
            with open(self.stdout_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self):
        """Stop (SIGINT, then SIGKILL after 2 s) and reap. Returns the exit status.

        SIGINT, not SIGTERM: pdproxy answers SIGTERM with a graceful drain
        (a drain delay for load balancers, then in-flight requests), SIGINT
        with an immediate clean exit, which still lets sanitizers report."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGINT)
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5.0)
        return self.proc.returncode

    def remove_logs(self):
        for p in (self.stderr_path, self.stdout_path):
            try:
                os.unlink(p)
            except OSError:
                pass


def listening_inodes(port):
    """Inodes of the TCP sockets listening on `port` (IPv4 and IPv6)."""
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        out.add(fields[9])
        except OSError:
            pass
    return out


def tcp_queues(local_port, remote_port):
    """(tx_queue, rx_queue) in bytes of the established loopback TCP socket
    local_port -> remote_port, from /proc/net/tcp; (0, 0) if not found.
    tx_queue: written by the application, not yet acknowledged by the peer;
    rx_queue: received, not yet read by the application."""
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                lp = int(fields[1].rsplit(":", 1)[1], 16)
                rp = int(fields[2].rsplit(":", 1)[1], 16)
                if lp == local_port and rp == remote_port and fields[3] == "01":
                    tx, rx = fields[4].split(":")
                    return int(tx, 16), int(rx, 16)
    except OSError:
        pass
    return 0, 0


def socket_inodes(pid):
    """Inodes of the sockets process `pid` has open."""
    out = set()
    d = "/proc/%d/fd" % pid
    try:
        fds = os.listdir(d)
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(os.path.join(d, fd))
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def run_pdproxy(args, env=None, timeout=5.0):
    """Run pdproxy to completion (for --help, --version, bad flags).
    Returns CompletedProcess with text stdout/stderr; raises on timeout."""
    p = subprocess.run([PDPROXY] + list(args), stdin=subprocess.DEVNULL, capture_output=True,
                       env=Proxy.clean_env(env), timeout=timeout)
    p.stdout = p.stdout.decode("utf-8", "replace")
    p.stderr = p.stderr.decode("utf-8", "replace")
    return p


# --------------------------------------------------------------------------
# Mock backend: actions


class Respond:
    """A complete response.

    framing: 'length' (Content-Length), 'chunked', or 'close' (no length, close
    after the body). `headers` is a list of (name, value); the framing header
    is added unless `raw_framing` is True (then the caller controls it).
    `delay` seconds before answering (the mock watches for the peer closing
    meanwhile)."""

    def __init__(self, status=200, headers=(), body=b"", framing="length", delay=0.0,
                 reason=None, raw_framing=False, then_close=False):
        self.then_close = then_close  # close after answering, without saying so
        self.status = status
        self.headers = list(headers)
        self.body = body if isinstance(body, (bytes, bytearray)) else body.encode("utf-8")
        self.framing = framing
        self.delay = delay
        self.reason = reason
        self.raw_framing = raw_framing


class Stream:
    """A streamed response: `chunks` is an iterable of (delay_s, bytes); each
    piece is written after its delay (the mock watches for the peer closing
    during the delay and stops if it does).

    framing: 'chunked' (each piece one HTTP chunk), 'close' (raw bytes,
    connection closed at the end) or 'length' (needs `length`).
    end: 'ok' (proper end), 'close' (close without finishing the framing:
    mid-stream failure), 'reset' (RST without finishing).
    sndbuf: SO_SNDBUF to set on the socket first (small values disable
    autotuning, so the bytes counted as sent track what the peer read)."""

    def __init__(self, status=200, headers=(), chunks=(), framing="chunked", end="ok",
                 length=None, sndbuf=None):
        self.status = status
        self.headers = list(headers)
        self.chunks = chunks
        self.framing = framing
        self.end = end
        self.length = length
        self.sndbuf = sndbuf


class Reset:
    """Read the request, then close with SO_LINGER 0 (the peer sees a RST)."""

    def __init__(self, delay=0.0):
        self.delay = delay


class CloseBeforeHeaders:
    """Read the request, then close normally without answering."""

    def __init__(self, delay=0.0):
        self.delay = delay


class Hang:
    """Never answer: wait until the peer closes, the mock stops, or max_s."""

    def __init__(self, max_s=15.0):
        self.max_s = max_s


# --------------------------------------------------------------------------
# Mock backend: recording


class MockRequest:
    def __init__(self, conn, method, target, version, headers, body, t_start, t_done, seq):
        self.conn = conn
        self.conn_id = conn.id
        self.method = method
        self.path = target
        self.version = version
        self.headers = headers  # list of (name, value), duplicates kept, in order
        self.body = body  # raw bytes (de-chunked when the request was chunked)
        self.t_start = t_start  # monotonic time the request line arrived
        self.t_done = t_done  # monotonic time the body was complete
        self.seq = seq  # order of arrival at this backend
        self.chunked = False
        self.probe = False  # a health/metrics probe (kept in MockBackend.probes)

    def header(self, name):
        return hdr_get(self.headers, name)

    def header_all(self, name):
        return hdr_all(self.headers, name)

    def json(self):
        return strict_json(self.body)

    def __repr__(self):
        return "<MockRequest %s %s conn=%d %dB>" % (self.method, self.path, self.conn_id,
                                                   len(self.body))


def is_probe(method, target):
    """pdproxy's own checks of an engine (active health checks, metrics
    scrapes): not part of any client request's P/D flow."""
    return method == "GET" and target.split("?")[0] in ("/health", "/metrics")


def default_probe_handler(req):
    if req.path.startswith("/metrics"):
        return Respond(200, [("Content-Type", "text/plain; version=0.0.4")],
                       b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                       b"vllm:kv_cache_usage_perc 0\n")
    return Respond(200, [], b"")


class MockConn:
    def __init__(self, cid, sock, backend):
        self.id = cid
        self.sock = sock
        try:
            self.local_port = sock.getsockname()[1]
            self.peer_port = sock.getpeername()[1]
        except OSError:  # the peer is already gone
            self.local_port = self.peer_port = 0
        self.backend = backend
        self.t_open = now()
        self.t_closed = None  # monotonic time the peer closed (EOF/RST seen), or we closed
        self.closed_by_peer = False
        self.closed = threading.Event()
        self.bytes_sent = 0  # response bytes written (headers + body), updated per send()
        self.send_log = []  # (monotonic time, cumulative bytes_sent) after each piece
        self.requests = []
        self.stash = bytearray()  # TLS: bytes read while watching for a close

    def mark_peer_closed(self):
        if self.t_closed is None:
            self.t_closed = now()
            self.closed_by_peer = True
        self.closed.set()

    def mark_closed_by_us(self):
        if self.t_closed is None:
            self.t_closed = now()
        self.closed.set()

    def wait_closed(self, timeout):
        self.closed.wait(timeout)
        return self.t_closed


class _PeerGone(Exception):
    pass


class _Stop(Exception):
    pass


class MockBackend:
    """HTTP/1.1 mock engine on 127.0.0.1:<port>.

    handler(req: MockRequest) -> action. The default handler answers 200 with
    an empty JSON object."""

    MAX_HEAD = 64 * 1024

    def __init__(self, handler=None, name="mock", port=0):
        self.name = name
        self.handler = handler or (lambda req: Respond(200, [("Content-Type", "application/json")],
                                                       b"{}"))
        self.requests = []  # every request except health/metrics probes
        self.probes = []  # GET /health, GET /metrics: pdproxy's own checks
        # Answers probes; None passes them to `handler` like any request.
        self.probe_handler = default_probe_handler
        self.conns = []
        self.errors = []  # exceptions raised by handlers (test bugs) or protocol errors
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._stop = threading.Event()
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind((HOST, port))
        self.lsock.listen(128)
        self.port = self.lsock.getsockname()[1]
        self._threads = []
        t = threading.Thread(target=self._accept_loop, name="%s-accept" % name, daemon=True)
        t.start()
        self._threads.append(t)

    # -- public

    def set_handler(self, handler):
        self.handler = handler

    @property
    def addr(self):
        return (HOST, self.port)

    def wait_requests(self, n, timeout=IO_TIMEOUT):
        """Wait until at least n requests have arrived; returns the list."""
        deadline = now() + timeout
        with self._cond:
            for _ in range(MAX_LOOP):
                if len(self.requests) >= n:
                    break
                left = deadline - now()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self.requests)

    def wait_probes(self, n, timeout):
        """Wait until at least n probes (GET /health, /metrics) arrived; returns how many."""
        deadline = now() + timeout
        with self._cond:
            for _ in range(MAX_LOOP):
                left = deadline - now()
                if len(self.probes) >= n or left <= 0:
                    break
                self._cond.wait(left)
            return len(self.probes)

    def conn_ids(self):
        """Connection id of each (non-probe) request, in arrival order."""
        with self._lock:
            return [r.conn_id for r in self.requests]

    def stop(self):
        self._stop.set()
        try:
            self.lsock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self.conns)
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(timeout=2.0)
        for c in conns:
            try:
                c.sock.close()
            except OSError:
                pass

    # -- internals

    def _accept_loop(self):
        for _ in range(MAX_LOOP):
            if self._stop.is_set():
                return
            try:
                r, _, _ = select.select([self.lsock], [], [], 0.1)
                if not r:
                    continue
                sock, _ = self.lsock.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                conn = MockConn(len(self.conns), sock, self)
                self.conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,),
                                 name="%s-conn%d" % (self.name, conn.id), daemon=True)
            t.start()
            self._threads.append(t)

    def _recv(self, conn, deadline=None):
        """recv() that notices the peer going away and our own stop."""
        sock = conn.sock
        if conn.stash:
            data, conn.stash = bytes(conn.stash), bytearray()
            return data
        for _ in range(MAX_LOOP):
            if self._stop.is_set():
                raise _Stop()
            try:
                # TLS may hold decrypted bytes that select() cannot see.
                pend = sock.pending() if hasattr(sock, "pending") else 0
                r = [sock] if pend else select.select([sock], [], [], 0.05)[0]
            except (OSError, ValueError):
                raise _Stop()
            if r:
                try:
                    data = sock.recv(256 * 1024)
                except (ConnectionResetError, ConnectionAbortedError, _SSLError):
                    conn.mark_peer_closed()
                    raise _PeerGone()
                except OSError:
                    raise _Stop()
                if not data:
                    conn.mark_peer_closed()
                    raise _PeerGone()
                return data
            if deadline is not None and now() >= deadline:
                raise socket.timeout()
        raise _Stop()

    def _read_request(self, conn, buf):
        """Read one request from conn; buf is a bytearray of bytes already
        read. Returns MockRequest or None on a clean EOF between requests."""
        for _ in range(MAX_LOOP):
            i = buf.find(b"\r\n\r\n")
            if i >= 0:
                break
            if len(buf) > self.MAX_HEAD:
                raise ValueError("request head too large")
            try:
                buf += self._recv(conn)
            except _PeerGone:
                return None
        t_start = now()
        head = bytes(buf[:i]).decode("latin-1")
        del buf[:i + 4]
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            raise ValueError("bad request line %r" % lines[0])
        method, target, version = parts
        headers = []
        for line in lines[1:]:
            if not line:
                continue
            if line[0] in " \t":
                raise ValueError("obsolete line folding in request head")
            k, sep, v = line.partition(":")
            if not sep or k != k.strip():
                raise ValueError("bad header line %r" % line)
            headers.append((k, v.strip(" \t")))
        if hdr_get(headers, "expect") and hdr_get(headers, "expect").lower() == "100-continue":
            self._send(conn, b"HTTP/1.1 100 Continue\r\n\r\n")
        te = hdr_get(headers, "transfer-encoding")
        cl = hdr_all(headers, "content-length")
        chunked = False
        if te is not None:
            if te.lower() != "chunked":
                raise ValueError("unsupported transfer-encoding %r" % te)
            if cl:
                raise ValueError("request has both Content-Length and Transfer-Encoding")
            chunked = True
            body = self._read_chunked(conn, buf)
        elif cl:
            if len(set(cl)) != 1:
                raise ValueError("conflicting Content-Length %r" % cl)
            n = int(cl[0])
            for _ in range(MAX_LOOP):
                if len(buf) >= n:
                    break
                buf += self._recv(conn)
            body = bytes(buf[:n])
            del buf[:n]
        else:
            body = b""
        with self._cond:
            probe = self.probe_handler is not None and is_probe(method, target)
            lst = self.probes if probe else self.requests
            req = MockRequest(conn, method, target, version, headers, body, t_start, now(),
                              len(lst))
            req.chunked = chunked
            req.probe = probe
            lst.append(req)
            conn.requests.append(req)
            self._cond.notify_all()
        return req

    def _read_chunked(self, conn, buf):
        body = bytearray()
        for _ in range(MAX_LOOP):
            for _ in range(MAX_LOOP):
                i = buf.find(b"\r\n")
                if i >= 0:
                    break
                buf += self._recv(conn)
            size_txt = bytes(buf[:i]).split(b";")[0].strip()
            size = int(size_txt, 16)
            del buf[:i + 2]
            if size == 0:
                # trailers until an empty line
                for _ in range(MAX_LOOP):
                    for _ in range(MAX_LOOP):
                        j = buf.find(b"\r\n")
                        if j >= 0:
                            break
                        buf += self._recv(conn)
                    line = bytes(buf[:j])
                    del buf[:j + 2]
                    if not line:
                        return bytes(body)
            for _ in range(MAX_LOOP):
                if len(buf) >= size + 2:
                    break
                buf += self._recv(conn)
            if bytes(buf[size:size + 2]) != b"\r\n":
                raise ValueError("chunk not followed by CRLF")
            body += buf[:size]
            del buf[:size + 2]
        raise ValueError("too many chunks")

    def _send(self, conn, data):
        """sendall() in pieces, counting bytes; raises _PeerGone if the peer left."""
        view = memoryview(data)
        sent_total = 0
        for _ in range(MAX_LOOP):
            if sent_total >= len(view):
                break
            if self._stop.is_set():
                raise _Stop()
            try:
                _, w, _ = select.select([], [conn.sock], [], 0.05)
            except (OSError, ValueError):
                raise _Stop()
            if not w:
                continue
            try:
                n = conn.sock.send(view[sent_total:sent_total + 256 * 1024])
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, _SSLError):
                conn.mark_peer_closed()
                raise _PeerGone()
            sent_total += n
            conn.bytes_sent += n
        conn.send_log.append((now(), conn.bytes_sent))

    def _peer_closed_within(self, conn, timeout):
        """Wait up to `timeout` s; returns True (and records it) if the peer
        closed the connection meanwhile. Does not consume request bytes."""
        deadline = now() + timeout
        for _ in range(MAX_LOOP):
            if self._stop.is_set():
                raise _Stop()
            left = deadline - now()
            if left <= 0:
                return False
            try:
                r, _, _ = select.select([conn.sock], [], [], min(left, 0.05))
            except (OSError, ValueError):
                raise _Stop()
            if r:
                try:
                    if hasattr(conn.sock, "pending"):
                        # TLS cannot peek: what arrives is kept for _recv.
                        data = conn.sock.recv(64 * 1024)
                        conn.stash += data
                    else:
                        data = conn.sock.recv(1, socket.MSG_PEEK)
                except (ConnectionResetError, ConnectionAbortedError, _SSLError):
                    conn.mark_peer_closed()
                    return True
                except OSError:
                    raise _Stop()
                if not data:
                    conn.mark_peer_closed()
                    return True
                # Unexpected bytes (pipelined request?) while answering: keep
                # waiting without spinning.
                time.sleep(min(left, 0.01))
        return False

    @staticmethod
    def _head(status, reason, headers):
        reason = reason or http.client.responses.get(status, "Status")
        lines = ["HTTP/1.1 %d %s" % (status, reason)]
        for k, v in headers:
            lines.append("%s: %s" % (k, v))
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _serve(self, conn):
        buf = bytearray()
        if MOCK_TLS and not getattr(self, "ctx", None):
            try:
                conn.sock.settimeout(5.0)
                conn.sock = mock_tls()[0].wrap_socket(conn.sock, server_side=True)
                conn.sock.settimeout(None)
            except OSError:
                conn.mark_peer_closed()
                return
        try:
            for _ in range(MAX_LOOP):
                req = self._read_request(conn, buf)
                if req is None:
                    return
                try:
                    action = (self.probe_handler if req.probe else self.handler)(req)
                except Exception as e:  # a test bug: record and answer 500
                    self.errors.append("handler raised %r for %r" % (e, req))
                    action = Respond(500, [("Content-Type", "text/plain")], b"mock handler error")
                keep = self._act(conn, req, action)
                if not keep:
                    return
        except (_PeerGone, _Stop):
            return
        except Exception as e:
            self.errors.append("%s conn %d: %r" % (self.name, conn.id, e))
        finally:
            if not conn.closed.is_set():
                # Closing on our side (end of a close-delimited response etc.).
                conn.mark_closed_by_us()
            try:
                conn.sock.close()
            except OSError:
                pass

    def _act(self, conn, req, a):
        """Perform one action; returns True to keep the connection for another request."""
        client_close = (req.header("connection") or "").lower() == "close"
        if isinstance(a, Respond):
            if a.delay and self._peer_closed_within(conn, a.delay):
                return False
            headers = list(a.headers)
            body = bytes(a.body)
            if not a.raw_framing:
                if a.framing == "length":
                    headers.append(("Content-Length", str(len(body))))
                elif a.framing == "chunked":
                    headers.append(("Transfer-Encoding", "chunked"))
                    body = (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
                elif a.framing == "close":
                    headers.append(("Connection", "close"))
            self._send(conn, self._head(a.status, a.reason, headers) + body)
            return a.framing != "close" and not client_close and not a.then_close
        if isinstance(a, Stream):
            if a.sndbuf:
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, a.sndbuf)
            headers = list(a.headers)
            if a.framing == "chunked":
                headers.append(("Transfer-Encoding", "chunked"))
            elif a.framing == "length":
                headers.append(("Content-Length", str(a.length)))
            elif a.framing == "close":
                headers.append(("Connection", "close"))
            self._send(conn, self._head(a.status, None, headers))
            count = 0
            for delay, piece in a.chunks:
                count += 1
                if count > MAX_LOOP:
                    break
                if delay and self._peer_closed_within(conn, delay):
                    return False
                if not piece:
                    continue
                if a.framing == "chunked":
                    self._send(conn, b"%x\r\n" % len(piece) + piece + b"\r\n")
                else:
                    self._send(conn, piece)
            if a.end == "reset":
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return False
            if a.end == "close":
                return False
            if a.framing == "chunked":
                self._send(conn, b"0\r\n\r\n")
            return a.framing != "close" and not client_close
        if isinstance(a, Reset):
            if a.delay and self._peer_closed_within(conn, a.delay):
                return False
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if isinstance(a, CloseBeforeHeaders):
            if a.delay and self._peer_closed_within(conn, a.delay):
                return False
            return False
        if isinstance(a, Hang):
            self._peer_closed_within(conn, a.max_s)
            return False
        raise TypeError("unknown mock action %r" % (a,))


# --------------------------------------------------------------------------
# Blackhole


class Blackhole:
    """A 127.0.0.1 port where connect() neither succeeds nor is refused.

    Method: listen(0) and never accept; fill the accept queue with our own
    connections. Linux then drops further SYNs (tcp_abort_on_overflow=0), so a
    connect() keeps retransmitting its SYN until it times out. `works` is True
    when a probe connect() really timed out after 0.3 s."""

    def __init__(self):
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.bind((HOST, 0))
        self.lsock.listen(0)
        self.port = self.lsock.getsockname()[1]
        self.fillers = []
        for _ in range(16):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex((HOST, self.port))
            self.fillers.append(s)
            _, w, _ = select.select([], [s], [], 0.2)
            if not w:
                break  # this one is stuck in SYN-SENT: the queue is full
        self.works = self._probe()

    def _probe(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(0.3)
        try:
            s.connect((HOST, self.port))
            return False
        except socket.timeout:
            return True
        except OSError:
            return False
        finally:
            s.close()

    def close(self):
        for s in self.fillers:
            s.close()
        self.lsock.close()


# --------------------------------------------------------------------------
# Raw client


class ProtocolError(Exception):
    pass


class _StopRead(Exception):
    pass


class RawResponse:
    def __init__(self):
        self.version = None
        self.status = None
        self.reason = None
        self.headers = []
        self.raw_head = b""
        self.body = bytearray()  # decoded body
        self.raw = bytearray()  # every byte of this response as received (head+body framing)
        self.framing = None  # 'chunked' | 'length' | 'close' | 'none'
        self.complete = False  # body ended as its framing says (0-chunk seen, length reached)
        self.eof = False  # connection closed by the server while/after reading
        self.reset = False  # ... with a RST
        self.timed_out = False
        self.t_sent = None
        self.t_head = None
        self.t_done = None
        self.arrivals = []  # (monotonic time, decoded body length) after each recv
        self.chunk_sizes = []
        self.interim = []  # 1xx statuses seen before this response
        self.stopped_early = False

    def header(self, name):
        return hdr_get(self.headers, name)

    def header_all(self, name):
        return hdr_all(self.headers, name)

    def json(self):
        return strict_json(bytes(self.body))

    def time_body_reached(self, n):
        """Monotonic time at which at least n decoded body bytes had arrived, or None."""
        for t, length in self.arrivals:
            if length >= n:
                return t
        return None

    def __repr__(self):
        return "<RawResponse %s %s framing=%s complete=%s eof=%s %dB>" % (
            self.status, self.reason, self.framing, self.complete, self.eof, len(self.body))


class RawClient:
    """One client TCP connection to pdproxy, driven by hand."""

    def __init__(self, port, host=HOST, rcvbuf=None, timeout=IO_TIMEOUT):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            # Before connect(), so the window is small from the start and
            # autotuning is off.
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(timeout)
        self.sock.connect((host, port))
        self.buf = bytearray()
        self.pos = 0
        self.eof = False
        self.reset = False
        self.t_close = None

    @staticmethod
    def build(method, path, body=None, headers=(), version="HTTP/1.1", host="pdproxy",
              chunked=False):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode("utf-8")
        elif isinstance(body, str):
            body = body.encode("utf-8")
        hs = list(headers)
        names = {k.lower() for k, _ in hs}
        if "host" not in names and version == "HTTP/1.1":
            hs.insert(0, ("Host", host))
        if body is not None:
            if chunked:
                hs.append(("Transfer-Encoding", "chunked"))
            elif "content-length" not in names:
                hs.append(("Content-Length", str(len(body))))
            if "content-type" not in names:
                hs.append(("Content-Type", "application/json"))
        head = "%s %s %s\r\n" % (method, path, version)
        head += "".join("%s: %s\r\n" % (k, v) for k, v in hs) + "\r\n"
        data = head.encode("latin-1") if isinstance(head, str) else head
        if body is not None:
            if chunked:
                step = max(1, len(body) // 3) if body else 1
                for i in range(0, len(body), step):
                    piece = body[i:i + step]
                    data += b"%x\r\n" % len(piece) + piece + b"\r\n"
                data += b"0\r\n\r\n"
            else:
                data += body
        return data

    def send(self, data):
        self.sock.sendall(data)
        self.t_sent = now()

    def request(self, method, path, body=None, headers=(), **kw):
        self.send(self.build(method, path, body, headers, **kw))

    def close(self, rst=False):
        if rst:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        try:
            self.sock.close()
        except OSError:
            pass
        self.t_close = now()
        return self.t_close

    # -- reading

    def _fill(self, deadline):
        """Read more bytes into self.buf. Returns False on EOF/RST, raises
        socket.timeout at the deadline."""
        if self.eof:
            return False
        left = deadline - now()
        if left <= 0:
            raise socket.timeout()
        self.sock.settimeout(min(left, 1.0))
        try:
            data = self.sock.recv(1024 * 1024)
        except socket.timeout:
            if now() >= deadline:
                raise
            return True
        except (ConnectionResetError, ConnectionAbortedError):
            self.eof = self.reset = True
            return False
        if not data:
            self.eof = True
            return False
        if self.pos > (1 << 20) and self.pos > len(self.buf) // 2:
            del self.buf[:self.pos]
            self.pos = 0
        self.buf += data
        return True

    def _avail(self):
        return len(self.buf) - self.pos

    def _take(self, n):
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def _line(self, deadline, limit=64 * 1024):
        for _ in range(MAX_LOOP):
            i = self.buf.find(b"\r\n", self.pos)
            if i >= 0:
                line = self._take(i - self.pos)
                self.pos += 2
                return line
            if self._avail() > limit:
                raise ProtocolError("line too long")
            if not self._fill(deadline):
                return None
        raise ProtocolError("too many reads for one line")

    def read_response(self, timeout=IO_TIMEOUT, head_only=False, method="POST",
                      on_progress=None, until=None, return_interim=False):
        """Read one response (skipping 1xx). Returns RawResponse; never raises
        for EOF (see .complete/.eof) or timeout (see .timed_out), raises
        ProtocolError for malformed framing. `until(r)`: stop reading (leaving
        the rest unread) as soon as it returns true after some body bytes
        arrived; r.stopped_early is then True. `return_interim`: return a 1xx
        response (head only) instead of skipping it."""
        r = RawResponse()
        if until is not None:
            inner = on_progress

            def on_progress(resp):
                if inner:
                    inner(resp)
                if until(resp):
                    raise _StopRead()
        r.t_sent = getattr(self, "t_sent", None)
        deadline = now() + timeout
        try:
            for _ in range(100):
                if not self._read_head(r, deadline):
                    return r
                if 100 <= r.status < 200:
                    if return_interim:
                        return r
                    r.interim.append(r.status)
                    continue
                break
            if head_only:
                return r
            self._read_body(r, deadline, method, on_progress)
        except socket.timeout:
            r.timed_out = True
        except _StopRead:
            r.stopped_early = True
        r.eof = self.eof
        r.reset = self.reset
        return r

    def _read_head(self, r, deadline):
        start = self.pos
        for _ in range(MAX_LOOP):
            i = self.buf.find(b"\r\n\r\n", self.pos)
            if i >= 0:
                break
            if self._avail() > 64 * 1024:
                raise ProtocolError("response head too large")
            if not self._fill(deadline):
                r.eof = True
                r.raw += self.buf[start:]
                return False
        head = self._take(i - self.pos)
        self.pos += 4
        r.raw_head = head + b"\r\n\r\n"
        r.raw += r.raw_head
        r.t_head = now()
        lines = head.decode("latin-1").split("\r\n")
        m = re.match(r"^(HTTP/\d\.\d) (\d{3})(?: (.*))?$", lines[0])
        if not m:
            raise ProtocolError("bad status line %r" % lines[0])
        r.version, r.status, r.reason = m.group(1), int(m.group(2)), m.group(3) or ""
        r.headers = []
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if not sep or not k or k != k.strip():
                raise ProtocolError("bad header line %r" % line)
            r.headers.append((k, v.strip(" \t")))
        return True

    def _read_body(self, r, deadline, method, on_progress):
        te = r.header("transfer-encoding")
        cls = r.header_all("content-length")
        if method == "HEAD" or r.status in (204, 304):
            r.framing = "none"
            r.complete = True
            r.t_done = now()
            return
        if te is not None:
            if cls:
                raise ProtocolError("both Transfer-Encoding and Content-Length")
            if te.lower() != "chunked":
                raise ProtocolError("unexpected Transfer-Encoding %r" % te)
            r.framing = "chunked"
            self._read_chunked(r, deadline, on_progress)
        elif cls:
            if len(set(cls)) != 1 or not cls[0].isdigit():
                raise ProtocolError("bad Content-Length %r" % cls)
            r.framing = "length"
            n = int(cls[0])
            for _ in range(MAX_LOOP):
                take = min(self._avail(), n - len(r.body))
                if take:
                    piece = self._take(take)
                    r.body += piece
                    r.raw += piece
                    r.arrivals.append((now(), len(r.body)))
                    if on_progress:
                        on_progress(r)
                if len(r.body) >= n:
                    r.complete = True
                    r.t_done = now()
                    return
                if not self._fill(deadline):
                    return
        else:
            r.framing = "close"
            for _ in range(MAX_LOOP):
                if self._avail():
                    piece = self._take(self._avail())
                    r.body += piece
                    r.raw += piece
                    r.arrivals.append((now(), len(r.body)))
                    if on_progress:
                        on_progress(r)
                if not self._fill(deadline):
                    r.complete = not self.reset
                    r.t_done = now()
                    return

    def _read_chunked(self, r, deadline, on_progress):
        for _ in range(MAX_LOOP):
            line = self._line(deadline)
            if line is None:
                return  # EOF before a chunk-size line: incomplete
            r.raw += line + b"\r\n"
            if not re.match(rb"^[0-9a-fA-F]+(;.*)?$", line):
                raise ProtocolError("bad chunk-size line %r" % line)
            size = int(line.split(b";")[0], 16)
            if size == 0:
                for _ in range(1000):  # trailers
                    t = self._line(deadline)
                    if t is None:
                        return
                    r.raw += t + b"\r\n"
                    if t == b"":
                        r.complete = True
                        r.t_done = now()
                        return
                raise ProtocolError("too many trailers")
            r.chunk_sizes.append(size)
            got = 0
            for _ in range(MAX_LOOP):
                take = min(self._avail(), size - got)
                if take:
                    piece = self._take(take)
                    r.body += piece
                    r.raw += piece
                    got += take
                    r.arrivals.append((now(), len(r.body)))
                    if on_progress:
                        on_progress(r)
                if got >= size:
                    break
                if not self._fill(deadline):
                    return
            for _ in range(MAX_LOOP):
                if self._avail() >= 2:
                    break
                if not self._fill(deadline):
                    return
            crlf = self._take(2)
            r.raw += crlf
            if crlf != b"\r\n":
                raise ProtocolError("chunk data not followed by CRLF (got %r)" % crlf)
        raise ProtocolError("too many chunks")

    def wait_eof(self, timeout):
        """Wait for the server to close; returns True if it did (extra bytes are kept)."""
        deadline = now() + timeout
        try:
            for _ in range(MAX_LOOP):
                if not self._fill(deadline):
                    return True
        except socket.timeout:
            return False
        return False


def raw_exchange(port, method, path, body=None, headers=(), timeout=IO_TIMEOUT, **kw):
    """One request on a fresh raw connection; returns the RawResponse."""
    c = RawClient(port, timeout=timeout)
    try:
        c.request(method, path, body, headers, **kw)
        return c.read_response(timeout=timeout, method=method)
    finally:
        c.close()


# --------------------------------------------------------------------------
# http.client helper


class HttpResult:
    def __init__(self, status, reason, headers, body, version):
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        self.version = version

    def header(self, name):
        return hdr_get(self.headers, name)

    def header_all(self, name):
        return hdr_all(self.headers, name)

    def json(self):
        return strict_json(self.body)

    def __repr__(self):
        return "<HttpResult %s %r>" % (self.status, self.body[:200])


def http_request(port, method, path, body=None, headers=None, timeout=IO_TIMEOUT):
    """An ordinary request through http.client on a fresh connection."""
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode("utf-8")
    elif isinstance(body, str):
        body = body.encode("utf-8")
    hs = dict(headers or {})
    if body is not None and not any(k.lower() == "content-type" for k in hs):
        hs["Content-Type"] = "application/json"
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=hs)
        resp = c.getresponse()
        data = resp.read()
        return HttpResult(resp.status, resp.reason, resp.getheaders(), data, resp.version)
    finally:
        c.close()


# --------------------------------------------------------------------------
# Canned engine answers


def default_p_kv(req_id="req", n=1):
    """kv_transfer_params as a vLLM prefill engine returns them."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2, 3 + n],
        "remote_engine_id": "engine-p-%d" % n,
        "remote_request_id": "%s-a1b2c3" % req_id,
        "remote_host": "127.0.0.1",
        "remote_port": 5600 + n,
        "tp_size": 1,
    }


def prefill_handler(kv=None, raw_body=None, status=200, content_type="application/json"):
    """Handler for a mock P: a completion with kv_transfer_params (default
    shape, or `kv`; or the literal bytes `raw_body`)."""

    def h(req):
        if raw_body is not None:
            body = raw_body
        else:
            rid = req.header("x-request-id") or "noid"
            doc = {"id": "cmpl-%s" % rid, "object": "text_completion", "created": 1,
                   "model": "m", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                   "kv_transfer_params": kv if kv is not None else default_p_kv(rid)}
            body = json.dumps(doc).encode("utf-8")
        return Respond(status, [("Content-Type", content_type)], body)

    return h


def decode_handler(body=None, status=200, content_type="application/json", framing="length"):
    """Handler for a mock D: a fixed body, or by default one naming the request."""

    def h(req):
        b = body
        if b is None:
            b = json.dumps({"id": "cmpl-d", "object": "text_completion",
                            "choices": [{"index": 0, "text": "decoded:%d" % req.seq,
                                         "finish_reason": "stop"}]}).encode("utf-8")
        return Respond(status, [("Content-Type", content_type)], b, framing=framing)

    return h


def sse_events(texts, done=True):
    out = []
    for i, t in enumerate(texts):
        ev = {"id": "cmpl-s", "object": "text_completion",
              "choices": [{"index": 0, "text": t, "finish_reason": None}]}
        out.append(("data: %s\n\n" % json.dumps(ev)).encode("utf-8"))
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


def completion_body(**extra):
    b = {"model": "m", "prompt": "hello", "max_tokens": 16}
    b.update(extra)
    return b


def chat_body(**extra):
    b = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
    b.update(extra)
    return b


# --------------------------------------------------------------------------
# unittest base


def _test_failed(tc):
    """Whether test case `tc` has recorded a failure or error so far (usable
    from a cleanup: unittest resets its own success flag for each part)."""
    outcome = getattr(tc, "_outcome", None)
    res = getattr(outcome, "result", None)
    if res is None:
        return True
    for test, _ in list(getattr(res, "failures", [])) + list(getattr(res, "errors", [])):
        if test is tc or getattr(test, "test_case", None) is tc:
            return True
    return False


class PxTestCase(unittest.TestCase):
    """Base class: start_proxy(), mock(), blackhole(), with cleanup, crash
    detection, and pdproxy's stderr printed when a test fails."""

    def setUp(self):
        if not os.access(PDPROXY, os.X_OK):
            self.fail("pdproxy binary not found at %s (set PX_BIN_DIR)" % PDPROXY)
        self._proxies = []
        self._mocks = []

    def mock(self, handler=None, name=None):
        m = MockBackend(handler, name=name or "mock%d" % len(self._mocks))
        self._mocks.append(m)
        self.addCleanup(self._stop_mock, m)
        return m

    def _stop_mock(self, m):
        m.stop()
        if m.errors:
            raise AssertionError("mock %s recorded errors: %s" % (m.name, m.errors))

    def blackhole(self):
        b = Blackhole()
        self.addCleanup(b.close)
        return b

    def proxy_args(self, prefill=(), decode=(), extra=()):
        """Flags for P backends `prefill` and D backends `decode`, each a list of
        MockBackend / int port / (host, port)."""

        def split(items):
            hosts, ports = [], []
            for it in items:
                if isinstance(it, MockBackend):
                    hosts.append(HOST)
                    ports.append(str(it.port))
                elif isinstance(it, tuple):
                    hosts.append(it[0])
                    ports.append(str(it[1]))
                else:
                    hosts.append(HOST)
                    ports.append(str(it))
            return hosts, ports

        args = []
        ph, pp = split(prefill)
        dh, dp = split(decode)
        if MOCK_TLS:
            for flag, hosts, ports in (("--prefill", ph, pp), ("--decode", dh, dp)):
                for h, p in zip(hosts, ports):
                    args += [flag, "https://%s:%s" % (h, p)]
            return args + ["--upstream-ca", mock_tls()[1]] + list(extra)
        if ph:
            args += ["--prefiller-hosts"] + ph + ["--prefiller-ports"] + pp
        if dh:
            args += ["--decoder-hosts"] + dh + ["--decoder-ports"] + dp
        return args + list(extra)

    def start_proxy(self, prefill=(), decode=(), extra=(), env=None, threads=2, args=None,
                    ready_timeout=5.0):
        """Start pdproxy listening on a free port; returns the Proxy (proxy.port).
        `args` replaces the generated backend flags entirely when given."""
        last = None
        for _ in range(3):
            port = free_port()
            a = ["--host", HOST, "--port", str(port)]
            if threads is not None:
                a += ["--threads", str(threads)]
            a += list(args) if args is not None else self.proxy_args(prefill, decode, extra)
            p = Proxy(a, env=env, port=port, ready_timeout=ready_timeout)
            p.spawn()
            self._proxies.append(p)
            self.addCleanup(self._stop_proxy, p)
            try:
                p.wait_ready()
            except ProxyStartError as e:
                last = e
                if "in use" not in p.stderr().lower():
                    raise
                continue
            if p.owns_port():
                return p
            last = ProxyStartError("port %d shared with another process" % port)
            p._expected_exit = True
            p.stop()
        raise last

    def _stop_proxy(self, p):
        died = p.proc is not None and p.proc.poll() is not None and not p._expected_exit
        rc = p.stop()
        failed = _test_failed(self) or died or os.environ.get("PX_TEST_VERBOSE")
        if failed:
            sys.stderr.write("\n----- pdproxy %s stderr (%s) -----\n%s\n----- end -----\n"
                             % (" ".join(p.args), self.id(), p.stderr()[-20000:]))
        san = SANITIZER_RE.search(p.stderr())
        if san and not failed:
            sys.stderr.write("\n----- pdproxy %s stderr (%s) -----\n%s\n----- end -----\n"
                             % (" ".join(p.args), self.id(), p.stderr()[-20000:]))
        p.remove_logs()
        if died:
            raise AssertionError("pdproxy exited during the test with status %s" % rc)
        if san:
            raise AssertionError("sanitizer report in pdproxy's stderr: %s" % san.group(0))

    # -- assertions

    def assertErrorJson(self, resp, status, msg=None):
        """resp (HttpResult or RawResponse) is an OpenAI-style error with `status`."""
        where = msg or ""
        self.assertEqual(resp.status, status, "%s status; body=%r" % (where, bytes(resp.body)[:300]))
        ct = resp.header("content-type") or ""
        self.assertTrue(ct.split(";")[0].strip().lower() == "application/json",
                        "%s Content-Type %r" % (where, ct))
        doc = strict_json(bytes(resp.body))
        self.assertIsInstance(doc, dict, where)
        self.assertIn("error", doc, where)
        err = doc["error"]
        self.assertIsInstance(err, dict, where)
        self.assertIsInstance(err.get("message"), str, "%s error.message %r" % (where, err))
        self.assertTrue(err["message"], "%s empty error.message" % where)
        self.assertIsInstance(err.get("type"), str, "%s error.type %r" % (where, err))
        # OpenAI's shape: `param` is always there, null when no parameter
        # is at fault (the proxy never names one).
        self.assertIn("param", err, "%s error without param: %r" % (where, err))
        self.assertIsNone(err["param"], "%s error.param %r" % (where, err))
        code = err.get("code")
        self.assertTrue(isinstance(code, int) and not isinstance(code, bool),
                        "%s error.code %r" % (where, code))
        self.assertEqual(code, status, where)
        return doc

    def assertChunkedComplete(self, resp, msg=None):
        self.assertFalse(resp.timed_out, msg)
        self.assertEqual(resp.framing, "chunked",
                         "%s expected Transfer-Encoding: chunked, head=%r" % (msg or "", resp.raw_head))
        self.assertTrue(resp.complete, "%s chunked body not terminated by 0-chunk" % (msg or ""))
        self.assertEqual(len(resp.header_all("transfer-encoding")), 1,
                         "%s Transfer-Encoding headers: %r" % (msg or "", resp.raw_head))

    def assertWarned(self, proxy, keyword, since=0, timeout=2.0):
        """pdproxy's stderr (from offset `since`) gets a warning-level line that contains keyword."""
        def find():
            text = proxy.stderr()[since:]
            return [l for l in text.splitlines() if keyword in l and WARN_RE.search(l)]
        lines = wait_until(find, timeout)
        self.assertTrue(lines, "no warning line containing %r in pdproxy stderr:\n%s"
                        % (keyword, proxy.stderr()[since:][-4000:]))
        return lines


# What AddressSanitizer, LeakSanitizer and UBSan print when they find something.
SANITIZER_RE = re.compile(r"ERROR: (Address|Leak|Thread|Memory)Sanitizer[^\n]*|"
                          r"[^\n]*runtime error:[^\n]*")

# A log line at warning level: "warn", "WARN", "warning", "level=warn", "W ".
WARN_RE = re.compile(r"(?i)\bwarn(ing)?\b")


def main():
    unittest.main(verbosity=2)
