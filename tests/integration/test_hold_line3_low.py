#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 30, "hold the line, third round": the Low items, one class each.

L1. --reuse-port: a second instance with --reuse-port joined a first one
    that did not opt in (its workers always set SO_REUSEPORT).
L2. Sidecar mode: the allowlist covered hosts only (any port on an allowed
    host was reachable through x-prefiller-host-port).
L3. Sidecar mode: a prefill's 4xx body reached the client.
L4. --decode-idle-timeout acted as a time-to-head with a wrong "sent
    nothing" message."""

import subprocess

from pdharness.case import main
from pdharness.mocks import decode_handler, prefill_handler
from pdharness.net import HOST, listening_inodes, socket_inodes, wait_until
from pdharness.procs import PDPROXY, Proxy
from pdharness.prod import ProdCase


class ReusePortJoinTest(ProdCase):
    """L1: only processes that all asked for --reuse-port share a port."""

    def test_opted_in_second_cannot_join_a_first_that_did_not(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], threads=2)
        p = subprocess.run([PDPROXY, "--host", HOST, "--port", str(px.port), "--threads", "2",
                            "--reuse-port"] + self.proxy_args([P], [D]),
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=10,
                           env=Proxy.clean_env())
        self.assertEqual(p.returncode, 2, p.stderr.decode()[-2000:])
        self.assertIn("in use", p.stderr.decode().lower())
        self.assertTrue(px.owns_port(), "the first instance lost its port")
        # The first instance's workers all serve: requests keep working.
        for _ in range(4):
            self.assertEqual(self.post(px).status, 200)

    def test_both_opted_in_share(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D], ["--reuse-port"])
        second = self.track_proxy(Proxy(["--host", HOST, "--port", str(px.port), "--reuse-port"]
                                        + self.proxy_args([P], [D]), port=px.port).spawn())
        listens = wait_until(lambda: not second.alive() or bool(
            listening_inodes(px.port) & socket_inodes(second.proc.pid)), 5.0, 0.02)
        self.assertTrue(second.alive() and listens, second.stderr())


if __name__ == "__main__":
    main()
