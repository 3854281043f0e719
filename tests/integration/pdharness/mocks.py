# SPDX-License-Identifier: Apache-2.0
"""Mock upstreams: a raw-socket HTTP/1.1 server standing in for a prefill or
decode engine, and the canned answers of one.

* ``MockBackend``: one thread per connection, keep-alive, chunked request
  bodies, ``Expect: 100-continue``. It records every request (method, path,
  headers as a list with duplicates, raw body bytes, connection id, arrival
  time) and answers through a per-test handler returning an action
  (``Respond``, ``Stream``, ``Reset``, ``CloseBeforeHeaders``, ``Hang``).
  Each connection records when the peer (pdproxy) closed it, so a test can
  assert that the proxy cancelled upstream work, and how many response bytes
  the mock has written (backpressure). pdproxy's own probes (GET /health,
  GET /metrics) are answered by the mock itself and kept apart in
  ``.probes``. ``HostMock``: the same on another loopback address.
* ``prefill_handler``, ``decode_handler``, ``engine_metrics_handler``,
  ``sse_events``, ``completion_body``, ``chat_body``: canned engine answers
  and request bodies.

With ``PX_MOCK_TLS=1`` in the environment every mock backend speaks HTTPS
(a throw-away CA made with the openssl CLI; ``mock_tls()`` names its file).

Every loop is bounded by a deadline and an iteration count."""

import http.client
import json
import os
import re
import select
import socket
import struct
import subprocess
import tempfile
import threading
import time

from pdharness.client import Message, hdr_all, hdr_get
from pdharness.net import HOST, IO_TIMEOUT, MAX_LOOP, Listener, now

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
        d = tempfile.mkdtemp(prefix="pdharness-tls-")
        atexit.register(shutil.rmtree, d, True)

        def run(args):
            subprocess.run(["openssl"] + args, cwd=d, check=True, capture_output=True,
                           timeout=60)
        run(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=pdharness throw-away CA", "-addext", "basicConstraints=critical,CA:TRUE",
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


# The kv_transfer_params pdproxy must put in every prefill request (docs/ARCHITECTURE.md §1).
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

XFER_ID = re.compile(r"^xfer-[0-9a-f]{32}$")


def sans_xfer(obj):
    """A copy of `obj` (a leg's request body, or its kv_transfer_params)
    without the transfer_id pdproxy puts on both legs of a disaggregated
    request, which must be there as pdproxy mints it ("xfer-" and 32 hex
    digits)."""
    obj = json.loads(json.dumps(obj))
    kvp = obj["kv_transfer_params"] if "kv_transfer_params" in obj else obj
    tid = kvp.pop("transfer_id", None)
    if not (isinstance(tid, str) and XFER_ID.match(tid)):
        raise AssertionError("no transfer_id minted by pdproxy in %r" % (obj,))
    return obj


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


class MockRequest(Message):
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


class MockBackend(Listener):
    """HTTP/1.1 mock engine on 127.0.0.1:<port>.

    handler(req: MockRequest) -> action. The default handler answers 200 with
    an empty JSON object."""

    MAX_HEAD = 64 * 1024

    def __init__(self, handler=None, name="mock", port=0, host=HOST):
        self.name = name
        self.bind_host = host
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
        Listener.__init__(self, host, port, backlog=128, name=name)
        self._threads = [self.accept_thread]
        self.start_accepting()

    # -- public

    def set_handler(self, handler):
        self.handler = handler

    @property
    def addr(self):
        return (self.bind_host, self.port)

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

    def accepted(self, sock):
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

    def _crlf(self, conn, buf):
        """Index of the first CRLF in buf (a bytearray), read from conn into
        buf until there is one."""
        for _ in range(MAX_LOOP):
            i = buf.find(b"\r\n")
            if i >= 0:
                return i
            buf += self._recv(conn)
        return buf.find(b"\r\n")

    def _read_chunked(self, conn, buf):
        body = bytearray()
        for _ in range(MAX_LOOP):
            i = self._crlf(conn, buf)
            size_txt = bytes(buf[:i]).split(b";")[0].strip()
            size = int(size_txt, 16)
            del buf[:i + 2]
            if size == 0:
                # trailers until an empty line
                for _ in range(MAX_LOOP):
                    j = self._crlf(conn, buf)
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


def prefill_handler(kv=None, raw_body=None, status=200, content_type="application/json",
                    delay=0.0, mode=None):
    """Handler for a mock P: a completion with kv_transfer_params (default
    shape, or `kv`; or the literal bytes `raw_body`), `delay` seconds late.
    `mode` ("push", "pull"): the default shape says "transfer_mode" as
    vLLM's NIXL connectors write it (a push prefill is what --dispatch
    concurrent sends both legs at once to)."""

    def h(req):
        if raw_body is not None:
            body = raw_body
        else:
            rid = req.header("x-request-id") or "noid"
            if kv is None and mode:
                doc_kv = dict(default_p_kv(rid), transfer_mode=mode)
            else:
                doc_kv = kv if kv is not None else default_p_kv(rid)
            doc = {"id": "cmpl-%s" % rid, "object": "text_completion", "created": 1,
                   "model": "m", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                   "kv_transfer_params": doc_kv}
            body = json.dumps(doc).encode("utf-8")
        return Respond(status, [("Content-Type", content_type)], body, delay=delay)

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


class HostMock(MockBackend):
    """MockBackend listening on `host` (any 127.x address) and `port` (0: any)."""

    def __init__(self, handler=None, name="mock", host="127.0.0.2", port=0):
        super().__init__(handler, name=name, port=port, host=host)


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
