# SPDX-License-Identifier: Apache-2.0
"""Loopback networking for the tests: ports, bounded waits, /proc/net.

* ``free_port`` / ``closed_port``: a 127.0.0.1 port nobody listens on.
* ``wait_until`` (poll a predicate, return its last value), ``wait_value``
  (poll a value until it is done, return the last one), ``wait_for`` (poll,
  raise on timeout), ``wait_http`` (poll a GET until 200),
  ``connect_refused``: every wait in the harness is one of these.
* ``listening_inodes``, ``socket_inodes``, ``tcp_queues``, ``read_by_peer``:
  /proc/net views.
* ``Listener``: a listening socket whose thread hands each accepted
  connection to ``accepted()``; the mocks and the tests' own servers.
* ``Blackhole``: a port where connect() neither succeeds nor is refused.

Every loop is bounded by a deadline and an iteration count."""

import http.client
import os
import select
import socket
import threading
import time

HOST = "127.0.0.1"

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


def wait_until(pred, timeout, interval=0.005):
    """Poll pred() until true or timeout; returns the last value of pred()."""
    deadline = now() + timeout
    for _ in range(MAX_LOOP):
        v = pred()
        if v or now() >= deadline:
            return v
        time.sleep(interval)
    return pred()


def wait_value(fn, done, timeout, interval=0.02):
    """Poll v = fn() until done(v) or timeout; returns the last v (for the
    caller's assertion, which then names what it saw)."""
    seen = [None]

    def check():
        seen[0] = fn()
        return done(seen[0])

    wait_until(check, timeout, interval)
    return seen[0]


def wait_for(pred, timeout, what, interval=0.05):
    """Poll pred() -> (ok, last) until ok; returns last, or raises
    AssertionError naming `what` and the last value on timeout."""
    ok, last = wait_value(pred, lambda r: r[0], timeout, interval)
    if ok:
        return last
    raise AssertionError("timed out waiting for %s (last: %r)" % (what, last))


def wait_http(port, path="/health", timeout=15.0, proc=None):
    """Poll GET `path` on `port` until it answers 200; raises RuntimeError on
    timeout or when `proc` (a procs.Proc) exits first."""
    def ok():
        if proc is not None and not proc.alive():
            raise RuntimeError("%s exited early:\n%s" % (proc.name, proc.log()))
        try:
            c = http.client.HTTPConnection(HOST, port, timeout=1)
            c.request("GET", path)
            r = c.getresponse()
            r.read()
            c.close()
            return r.status == 200
        except OSError:
            return False

    if not wait_until(ok, timeout, 0.02):
        raise RuntimeError("port %d not ready after %.0fs" % (port, timeout))


def port_accepts(port, host=HOST, timeout=0.5):
    """True when connect() to host:port succeeds right now."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


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


def read_by_peer(local_port, remote_port):
    """True when everything written on the established loopback connection
    local_port -> remote_port has been read by the application at the other
    end: our send queue and the peer's receive queue are both empty (a
    piece the peer has read() is one it has seen apart from the next).
    Also True when the connection is not found (closed: nothing left to read)."""
    tx, _ = tcp_queues(local_port, remote_port)
    _, rx = tcp_queues(remote_port, local_port)
    return tx == 0 and rx == 0


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


# --------------------------------------------------------------------------
# Blackhole


class Listener:
    """A TCP listener on host:port (port 0: any) whose accept thread, once
    start_accepting() is called, hands every connection to accepted(sock)
    until stop_accepting()."""

    def __init__(self, host=HOST, port=0, backlog=128, rcvbuf=None, name="listener"):
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if rcvbuf:
            # Set before any connection exists: shrinking it on an accepted
            # socket that already advertised a larger window (the sender may
            # have written at once) stalls the flow unpredictably.
            self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.lsock.bind((host, port))
        self.lsock.listen(backlog)
        self.port = self.lsock.getsockname()[1]
        self._stop = threading.Event()
        self.accept_thread = threading.Thread(target=self._accept_loop, name="%s-accept" % name,
                                              daemon=True)

    def accepted(self, sock):
        raise NotImplementedError

    def start_accepting(self):
        self.accept_thread.start()
        return self

    def stop_accepting(self, join=2.0):
        """Stops the accept thread (waiting up to `join` s) and closes the listener."""
        self._stop.set()
        if self.accept_thread.is_alive():
            self.accept_thread.join(join)
        try:
            self.lsock.close()
        except OSError:
            pass

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
            self.accepted(sock)


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


