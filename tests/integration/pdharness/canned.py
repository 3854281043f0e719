# SPDX-License-Identifier: Apache-2.0
"""Canned engines and a fast client, for the tests that count what pdproxy
spends per request or push many requests through it: an engine that
answers every request with the same response in one send (so pdproxy reads
each answer in one read), and a client that sends each request in one send
on a few keep-alive connections.

Every loop is bounded in count; sockets have timeouts."""

import socket
import threading

from pdharness.net import HOST

PBODY = (b'{"id":"cmpl-b","object":"text_completion","created":1,"model":"m","choices":'
         b'[{"index":0,"text":" a","finish_reason":"length"}],"usage":{"prompt_tokens":9,'
         b'"completion_tokens":1,"total_tokens":10},"kv_transfer_params":{"do_remote_prefill":'
         b'true,"do_remote_decode":false,"remote_block_ids":[1,2,3],"remote_engine_id":"p0",'
         b'"remote_request_id":"cmpl-b-0","remote_host":"127.0.0.1","remote_port":5600,'
         b'"tp_size":1}}')
DBODY = (b'{"id":"cmpl-b","object":"text_completion","created":1,"model":"m","choices":'
         b'[{"index":0,"text":" jumps over the lazy dog","finish_reason":"length"}],'
         b'"usage":{"prompt_tokens":9,"completion_tokens":8,"total_tokens":17}}')
REQ_BODY = b'{"model":"m","prompt":"the quick brown fox","max_tokens":8}'


def read_request(sock, buf):
    """One request (head and Content-Length body) off `sock`; returns the
    rest of `buf`, or None at EOF."""
    for _ in range(10000):
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            n = 0
            for line in buf[:end].split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    n = int(v)
            if len(buf) >= end + 4 + n:
                return buf[end + 4 + n:]
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    return None


class Canned:
    """An engine that answers every request with the same response, written
    in one send (so pdproxy reads each answer in one read)."""

    def __init__(self, body):
        self.answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body)) + body
        self.ls = socket.socket()
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind((HOST, 0))
        self.ls.listen(128)
        self.port = self.ls.getsockname()[1]
        self.conns = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        for _ in range(1000):
            try:
                s, _ = self.ls.accept()
            except OSError:
                return
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns.append(s)
            threading.Thread(target=self.serve, args=(s,), daemon=True).start()

    def serve(self, s):
        buf = b""
        try:
            for _ in range(1000000):
                buf = read_request(s, buf)
                if buf is None:
                    return
                s.sendall(self.answer)
        except OSError:
            return

    def close(self):
        self.ls.close()
        for s in self.conns:
            try:
                s.close()
            except OSError:
                pass


def canned_engines(tc):
    """A canned prefill engine and a canned decode engine, closed at test
    case `tc`'s cleanup."""
    p, d = Canned(PBODY), Canned(DBODY)
    tc.addCleanup(p.close)
    tc.addCleanup(d.close)
    return p, d


def response_length(buf):
    """The length of the complete response at the start of buf (Content-Length
    or chunked), or None while it is incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buf[:end].lower()
    pos = end + 4
    if b"transfer-encoding: chunked" not in head:
        k = head.find(b"content-length:")
        n = int(head[k + 15:].split(b"\r\n")[0]) if k >= 0 else 0
        return pos + n if len(buf) >= pos + n else None
    for _ in range(10000):
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(buf[pos:eol].split(b";")[0], 16)
        pos = eol + 2 + size + 2
        if len(buf) < pos:
            return None
        if size == 0:
            return pos
    return None


def drive(port, n, clients, rid=None, timeout=10.0, body=REQ_BODY):
    """n completions (`body`) through pdproxy on `clients` keep-alive
    connections, each request in one send; returns how many were answered 200. With
    `rid`, request k of connection i carries X-Request-Id rid-i-k. A
    connection that waits `timeout` seconds for an answer stops there."""
    ok = [0] * clients

    def request(i, k):
        extra = b"X-Request-Id: %s-%d-%d\r\n" % (rid.encode(), i, k) if rid else b""
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def one(i, count):
        plain = request(i, 0)
        buf = b""
        try:
            s = socket.create_connection((HOST, port), timeout=timeout)
        except OSError:
            return
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for k in range(count):
                s.sendall(request(i, k) if rid else plain)
                for _ in range(1000):
                    m = response_length(buf)
                    if m is not None:
                        if buf.startswith(b"HTTP/1.1 200"):
                            ok[i] += 1
                        buf = buf[m:]
                        break
                    data = s.recv(65536)
                    if not data:
                        return
                    buf += data
        except OSError:
            return
        finally:
            s.close()

    ts = [threading.Thread(target=one, args=(i, n // clients)) for i in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout * n)
    return sum(ok)
