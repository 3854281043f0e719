# SPDX-License-Identifier: Apache-2.0
"""A vLLM KV-event publisher for the tests, standard library only.

It speaks ZeroMQ's wire protocol (ZMTP 3.0, NULL mechanism: RFC 23) as a
PUB socket sending multipart [topic, 8-byte big-endian sequence, msgpack
KVEventBatch], and optionally as the ROUTER replay socket of vLLM's
ZmqEventPublisher (vllm/distributed/kv_events.py): a request
["", start sequence] is answered with ["", seq, payload] for every buffered
batch from start, then ["", -1, b""]. The events are packed with a small
msgpack encoder below, in msgspec's array layout (tag first) or its map
layout ("type" tag), as vLLM's releases send them.

pdproxy's libzmq is the peer, so everything crossing the wire is real
ZeroMQ; the publisher can also send what no engine would (garbage, huge
frames, floods) for the hostile cases. Every wait is bounded."""

import socket
import struct
import threading
import time

from pdharness.net import wait_until

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ---------------------------------------------------------------- msgpack

def packb(o):
    out = bytearray()
    _pack(o, out)
    return bytes(out)


def _pack(o, out):
    if o is None:
        out.append(0xc0)
    elif o is True:
        out.append(0xc3)
    elif o is False:
        out.append(0xc2)
    elif isinstance(o, int):
        if 0 <= o < 128:
            out.append(o)
        elif -32 <= o < 0:
            out.append(o & 0xff)
        elif o >= 0:
            out += b"\xcf" + struct.pack(">Q", o)
        else:
            out += b"\xd3" + struct.pack(">q", o)
    elif isinstance(o, float):
        out += b"\xcb" + struct.pack(">d", o)
    elif isinstance(o, str):
        b = o.encode()
        out += b"\xdb" + struct.pack(">I", len(b)) + b
    elif isinstance(o, (bytes, bytearray)):
        out += b"\xc6" + struct.pack(">I", len(o)) + bytes(o)
    elif isinstance(o, (list, tuple)):
        out += b"\xdd" + struct.pack(">I", len(o))
        for x in o:
            _pack(x, out)
    elif isinstance(o, dict):
        out += b"\xdf" + struct.pack(">I", len(o))
        for k, v in o.items():
            _pack(k, out)
            _pack(v, out)
    else:
        raise TypeError(type(o))


# ---------------------------------------------------------------- events

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name")


def stored(hashes, parent, tokens, block_size, lora_name=None):
    return ("BlockStored", [list(hashes), parent, list(tokens), block_size, None, "GPU",
                            lora_name])


def removed(hashes):
    return ("BlockRemoved", [list(hashes), "GPU"])


def cleared():
    return ("AllBlocksCleared", [])


def batch(events, layout="array", ts=None):
    ts = time.time() if ts is None else ts
    if layout == "array":
        return packb([ts, [[tag] + fields for tag, fields in events], 0])
    evs = []
    for tag, fields in events:
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": ("block_hashes", "medium"),
                 "AllBlocksCleared": ()}[tag]
        d = {"type": tag}
        d.update(zip(names, fields))
        evs.append(d)
    return packb({"ts": ts, "events": evs, "data_parallel_rank": 0})


# ---------------------------------------------------------------- ZMTP

def _greeting():
    return (b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00")
            + b"\x00" + b"\x00" * 31)


def _frame(body, more=False, command=False):
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def _ready(socket_type):
    name = b"Socket-Type"
    props = bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type
    return _frame(b"\x05READY" + props, command=True)


def _recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        c = s.recv(n - len(buf))
        if not c:
            raise ConnectionError("peer closed")
        buf += c
    return buf


def _read_frame(s):
    flags = _recv_exact(s, 1)[0]
    n = struct.unpack(">Q", _recv_exact(s, 8))[0] if flags & 2 else _recv_exact(s, 1)[0]
    if n > 1 << 20:
        raise ConnectionError("frame too large")
    return flags, _recv_exact(s, n)


def _read_message(s):
    """One multipart message (commands skipped)."""
    parts = []
    while True:
        flags, body = _read_frame(s)
        if flags & 4:
            continue
        parts.append(body)
        if not flags & 1:
            return parts


def _multipart(parts):
    return b"".join(_frame(p, more=i < len(parts) - 1) for i, p in enumerate(parts))


class _Server:
    """Accepts ZMTP peers on host:port; on_peer(sock) runs per peer in a thread."""

    def __init__(self, host, port, socket_type, on_peer):
        self.ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind((host, port))
        self.ls.listen(16)
        self.ls.settimeout(0.2)
        self.port = self.ls.getsockname()[1]
        self.type = socket_type
        self.on_peer = on_peer
        self.stopped = False
        self.peers = []
        self.lock = threading.Lock()
        self.t = threading.Thread(target=self._accept, daemon=True)
        self.t.start()

    def _accept(self):
        while not self.stopped:
            try:
                c, _ = self.ls.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        try:
            c.settimeout(10)
            c.sendall(_greeting())
            _recv_exact(c, 64)
            c.sendall(_ready(self.type))
            flags, _ = _read_frame(c)  # the peer's READY
            c.settimeout(None)
            with self.lock:
                self.peers.append(c)
            self.on_peer(c)
        except (OSError, ConnectionError):
            pass
        finally:
            with self.lock:
                if c in self.peers:
                    self.peers.remove(c)
            c.close()

    def close(self):
        self.stopped = True
        self.ls.close()
        self.t.join(2)
        with self.lock:
            for c in self.peers:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Publisher:
    """A KV-event publisher on host:port (PUB) and, with replay_port, its
    replay socket (ROUTER). publish() numbers batches from `seq` on and
    keeps them for replay (at most `buffer` of them)."""

    def __init__(self, host, port=0, replay_port=None, buffer=10000, seq=0):
        self.seq = seq
        self.buffer = []
        self.buffer_max = buffer
        self.replay_requests = []
        self.pub = _Server(host, port, b"PUB", self._discard)
        self.port = self.pub.port
        self.rep = None
        if replay_port is not None:
            self.rep = _Server(host, replay_port, b"ROUTER", self._replay)
            self.replay_port = self.rep.port

    @staticmethod
    def _discard(c):
        while c.recv(65536):  # subscriptions: pdproxy subscribes to everything
            pass

    def _replay(self, c):
        while True:
            parts = _read_message(c)
            if len(parts) != 2 or parts[0] != b"" or len(parts[1]) != 8:
                continue  # vLLM logs and ignores malformed requests
            start = int.from_bytes(parts[1], "big")
            self.replay_requests.append(start)
            out = b""
            for seq, payload in list(self.buffer):
                if seq >= start:
                    out += _multipart([b"", seq.to_bytes(8, "big"), payload])
            c.sendall(out + _multipart([b"", END_SEQ, b""]))

    def wait_subscriber(self, timeout=10.0):
        if not wait_until(lambda: len(self.pub.peers) > 0, timeout):
            raise AssertionError("no subscriber connected to the publisher on port %d"
                                 % self.port)
        if self.rep is not None and not wait_until(lambda: len(self.rep.peers) > 0, timeout):
            raise AssertionError("no replay client connected on port %d" % self.replay_port)

    def send_raw(self, parts):
        data = _multipart(parts)
        with self.pub.lock:
            peers = list(self.pub.peers)
        for c in peers:
            try:
                c.sendall(data)
            except OSError:
                pass

    def publish(self, events, layout="array", send=True, topic=b"kv@test"):
        """Sends one batch with the next sequence; send=False makes a gap
        (the batch is only buffered for replay)."""
        payload = batch(events, layout)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        del self.buffer[:-self.buffer_max]
        if send:
            self.send_raw([topic, seq.to_bytes(8, "big"), payload])
        return seq

    def close(self):
        self.pub.close()
        if self.rep is not None:
            self.rep.close()
