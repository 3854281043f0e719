# SPDX-License-Identifier: Apache-2.0
"""Clients of pdproxy: a raw socket one and http.client for ordinary cases.

* ``RawClient``: a socket-level HTTP/1.1 client that reads responses
  incrementally with timestamps, decodes chunked encoding byte-exactly and
  strictly, and reports whether a chunked body ended with its terminating
  0-chunk or the connection was closed before it. ``raw_exchange``: one
  request on a fresh connection.
* ``http_request``: ``http.client`` for ordinary cases (an ``HttpResult``).
* ``post_json`` and ``answer_text``: a completion request and the text of
  its answer, JSON or SSE.
* ``strict_json``, ``hdr_get``, ``hdr_all``, ``errmsg``: reading answers.
* ``run_concurrently``: many clients at once on a bounded pool of threads.

Every loop is bounded by a deadline and an iteration count."""

import http.client
import json
import re
import socket
import struct
import threading
import time

from pdharness.net import HOST, IO_TIMEOUT, MAX_LOOP, now

UUID4_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")

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

# --------------------------------------------------------------------------
# Raw client


class Message:
    """header(), header_all() and json() of a request or response with
    .headers (a list of pairs, duplicates kept) and .body (bytes)."""

    def header(self, name):
        return hdr_get(self.headers, name)

    def header_all(self, name):
        return hdr_all(self.headers, name)

    def json(self):
        return strict_json(bytes(self.body))


class ProtocolError(Exception):
    pass


class _StopRead(Exception):
    pass


class RawResponse(Message):
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


class HttpResult(Message):
    def __init__(self, status, reason, headers, body, version):
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body
        self.version = version

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


def errmsg(resp):
    try:
        return json.loads(bytes(resp.body))["error"]["message"]
    except Exception:
        return repr(bytes(resp.body)[:300])


def post_json(port, path, body, stream=False, timeout=60, headers=None):
    """POSTs JSON; returns (status, headers, raw body bytes)."""
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


def run_concurrently(fn, n, workers=None, timeout=30.0):
    """Runs fn(i) for i in range(n) on `workers` threads (default n), waiting
    at most `timeout` seconds for them; returns (the results in order, an
    exception returned as it is; whether every thread finished)."""
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
    return results, not any(t.is_alive() for t in ts)
