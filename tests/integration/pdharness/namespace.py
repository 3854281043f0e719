# SPDX-License-Identifier: Apache-2.0
"""pdproxy in a mount namespace of its own (unshare -m, root only), with
/etc/hosts and /etc/resolv.conf replaced by files of the test's, and a name
server that never answers: names resolve as a test says, without touching
the machine's own files.

* ``unshare_usable()``: whether this process may run ``unshare -m``.
* ``mount_prefix(hosts, resolv=None)``: the command prefix (procs.Proxy's
  ``prefix``) that bind-mounts the files, then execs the command after it.
* ``StallingDns``: a UDP "name server" on ``STALL_DNS``:53 that reads
  queries and never answers.

Every loop is bounded by an iteration count."""

import os
import shutil
import socket
import subprocess
import threading

from pdharness.net import MAX_LOOP

STALL_DNS = "127.0.0.98"

_HOSTS = 'mount --bind "$0" /etc/hosts && exec "$@"'
_HOSTS_RESOLV = ('mount --bind "$0" /etc/hosts && mount --bind "$1" /etc/resolv.conf && '
                 'shift && exec "$@"')


def unshare_usable():
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    try:
        p = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=5)
        return p.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def mount_prefix(hosts, resolv=None):
    """["unshare", "-m", "sh", "-c", ...]: /etc/hosts from file `hosts` (and
    /etc/resolv.conf from file `resolv`) for the command that follows."""
    if resolv is None:
        return ["unshare", "-m", "sh", "-c", _HOSTS, hosts]
    return ["unshare", "-m", "sh", "-c", _HOSTS_RESOLV, hosts, resolv]


class StallingDns:
    """A UDP "name server" on STALL_DNS:53 that reads queries and never
    answers; `queries` counts them."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((STALL_DNS, 53))
        self.sock.settimeout(0.2)
        self.queries = 0
        self.stop = False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        for _ in range(MAX_LOOP):
            if self.stop:
                return
            try:
                self.sock.recvfrom(4096)
                self.queries += 1
            except socket.timeout:
                pass
            except OSError:
                return

    def close(self):
        self.stop = True
        self.t.join(2)
        self.sock.close()
