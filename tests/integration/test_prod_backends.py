#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 5 item 1, backends: --prefill/--decode URLs (repeatable), the toy
flags, and DNS names re-resolved every --dns-refresh seconds.

The DNS case runs pdproxy in a private mount namespace (unshare -m) with a
temporary file bind-mounted over /etc/hosts; rewriting that file (same inode)
moves the names between mocks listening on 127.0.0.2..127.0.0.5."""

import os
import shutil
import subprocess
import tempfile
import time
import unittest

from pdharness.client import http_request
from pdharness.mocks import PREFILL_KV, HostMock, decode_handler, prefill_handler, sans_xfer
from pdharness.namespace import mount_prefix
from pdharness.net import HOST, now, wait_value
from pdharness.prod import ProdCase
from pdharness.prom import prom

def healthcheck(port):
    r = http_request(port, "GET", "/healthcheck")
    assert r.status == 200, r
    d = r.json()
    return d["prefill_instances"], d["decode_instances"]


def ns_usable():
    """Whether unshare -m plus a bind mount over /etc/hosts works here."""
    if not shutil.which("unshare"):
        return False, "unshare not installed"
    fd, path = tempfile.mkstemp(prefix="pdproxy-hosts-")
    os.write(fd, b"127.0.0.2 probe.pdproxy-test\n")
    os.close(fd)
    try:
        p = subprocess.run(mount_prefix(path) + ["getent", "hosts", "probe.pdproxy-test"],
                           capture_output=True, timeout=10)
        if p.returncode != 0 or b"127.0.0.2" not in p.stdout:
            return False, ("unshare -m / mount --bind over /etc/hosts not permitted: rc=%d %s"
                           % (p.returncode, p.stderr.decode(errors="replace").strip()))
        return True, ""
    finally:
        os.unlink(path)


def same_port_mocks(hosts, handler_for, name):
    """One HostMock per address in `hosts`, all on the same port."""
    last = None
    for _ in range(20):
        mocks = []
        try:
            first = HostMock(handler_for(hosts[0]), name="%s@%s" % (name, hosts[0]), host=hosts[0])
            mocks.append(first)
            for h in hosts[1:]:
                mocks.append(HostMock(handler_for(h), name="%s@%s" % (name, h), host=h,
                                      port=first.port))
            return mocks
        except OSError as e:
            last = e
            for m in mocks:
                m.stop()
    raise last


class UrlBackendsTest(ProdCase):
    def test_prefill_and_decode_urls_repeatable(self):
        P = [self.mock(prefill_handler(), name="P%d" % i) for i in range(2)]
        D = [self.mock(decode_handler(), name="D%d" % i) for i in range(2)]
        args = []
        for m in P:
            args += ["--prefill", "http://127.0.0.1:%d" % m.port]
        for m in D:
            args += ["--decode", "http://127.0.0.1:%d/" % m.port]
        px = self.start(args=args)
        # The URLs replace the toy flags' defaults (localhost:8100/8200).
        self.assertEqual(healthcheck(px.port), (2, 2))
        for i in range(8):
            r = self.post(px)
            self.assertEqual(r.status, 200, r)
        self.assertEqual([len(m.requests) for m in P], [4, 4], "round robin over the --prefill URLs")
        self.assertEqual([len(m.requests) for m in D], [4, 4], "round robin over the --decode URLs")
        for m in P:
            self.assertEqual(sans_xfer(m.requests[0].json()["kv_transfer_params"]), PREFILL_KV)
            self.assertEqual(m.requests[0].path, "/v1/completions")
        for m in D:
            self.assertEqual(m.requests[0].path, "/v1/completions")
            self.assertTrue(m.requests[0].json()["kv_transfer_params"]["do_remote_prefill"])

    def test_toy_flags_several_instances(self):
        P = [self.mock(prefill_handler(), name="P%d" % i) for i in range(3)]
        D = [self.mock(decode_handler(), name="D%d" % i) for i in range(2)]
        px = self.start(P, D)
        self.assertEqual(healthcheck(px.port), (3, 2))
        for i in range(6):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual([len(m.requests) for m in P], [2, 2, 2])
        self.assertEqual([len(m.requests) for m in D], [3, 3])

    def test_toy_flags_and_urls_together(self):
        P = [self.mock(prefill_handler(), name="P%d" % i) for i in range(2)]
        D = self.mock(decode_handler(), name="D")
        px = self.start(args=["--prefiller-hosts", HOST, "--prefiller-ports", str(P[0].port),
                              "--prefill", "http://127.0.0.1:%d" % P[1].port,
                              "--decode", "http://127.0.0.1:%d" % D.port])
        self.assertEqual(healthcheck(px.port), (2, 1))
        for i in range(4):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual([len(m.requests) for m in P], [2, 2])


class DnsDiscoveryTest(ProdCase):
    REFRESH = 0.5

    def setUp(self):
        super().setUp()
        ok, why = ns_usable()
        if not ok:
            self.skipTest(why)
        fd, self.hosts = tempfile.mkstemp(prefix="pdproxy-hosts-")
        os.close(fd)
        self.addCleanup(os.unlink, self.hosts)

    def write_hosts(self, lines):
        # Same inode: the bind mount pins it, a rename would not be seen.
        with open(self.hosts, "r+") as f:
            f.seek(0)
            f.write("127.0.0.1 localhost\n" + "".join(l + "\n" for l in lines))
            f.truncate()
            f.flush()
            os.fsync(f.fileno())

    def start_ns(self, args):
        """pdproxy in its own mount namespace, /etc/hosts replaced by self.hosts."""
        return self.start_proxy(args=["--drain-delay", "0", "--health-interval", "0"] + args,
                                prefix=mount_prefix(self.hosts))

    def track(self, mocks):
        for m in mocks:
            self._mocks.append(m)
            self.addCleanup(self._stop_mock, m)
        return {m.bind_host: m for m in mocks}

    def wait_counts(self, px, want, limit):
        t0 = now()
        got = wait_value(lambda: healthcheck(px.port), lambda got: got == want, limit)
        self.assertEqual(got, want, "/healthcheck instance counts %.1fs after rewriting "
                         "/etc/hosts (--dns-refresh %g)" % (now() - t0, self.REFRESH))
        return now() - t0

    def new_requests(self, P, D, n):
        before = {h: len(m.requests) for h, m in list(P.items()) + list(D.items())}
        for i in range(n):
            r = self.post(self.px)
            self.assertEqual(r.status, 200, r)
        return {h: len(m.requests) - before[h] for h, m in list(P.items()) + list(D.items())}

    def test_names_re_resolved_every_dns_refresh(self):
        P = self.track(same_port_mocks(["127.0.0.2", "127.0.0.3"],
                                       lambda h: prefill_handler(), "P"))
        D = self.track(same_port_mocks(["127.0.0.4", "127.0.0.5"],
                                       lambda h: decode_handler(), "D"))
        pport = P["127.0.0.2"].port
        dport = D["127.0.0.4"].port
        self.write_hosts(["127.0.0.2 pnode.pdproxy-test", "127.0.0.4 dnode.pdproxy-test"])
        self.px = px = self.start_ns(["--prefill", "http://pnode.pdproxy-test:%d" % pport,
                                      "--decode", "http://dnode.pdproxy-test:%d" % dport,
                                      "--dns-refresh", str(self.REFRESH)])
        self.assertEqual(healthcheck(px.port), (1, 1))
        got = self.new_requests(P, D, 3)
        self.assertEqual(got, {"127.0.0.2": 3, "127.0.0.3": 0, "127.0.0.4": 3, "127.0.0.5": 0})
        # The URL keeps the name for Host while the connection goes to the address.
        self.assertTrue(P["127.0.0.2"].requests[0].header("host").startswith("pnode.pdproxy-test"),
                        P["127.0.0.2"].requests[0].headers)

        # The prefill name gains an address.
        self.write_hosts(["127.0.0.2 pnode.pdproxy-test", "127.0.0.3 pnode.pdproxy-test",
                          "127.0.0.4 dnode.pdproxy-test"])
        self.wait_counts(px, (2, 1), 2 * self.REFRESH + 0.5)
        got = self.new_requests(P, D, 4)
        self.assertEqual((got["127.0.0.2"], got["127.0.0.3"]), (2, 2),
                         "round robin over both addresses of the name: %r" % got)
        labels = {l["backend"] for n, l, v in prom(px.port)
                  if n == "pdproxy_backend_up" and l.get("role") == "prefill"}
        self.assertEqual(labels, {"127.0.0.2:%d" % pport, "127.0.0.3:%d" % pport})

        # Both names move: the old addresses get no more traffic.
        self.write_hosts(["127.0.0.3 pnode.pdproxy-test", "127.0.0.5 dnode.pdproxy-test"])
        t = self.wait_counts(px, (1, 1), 2 * self.REFRESH + 0.5)
        # Counts can settle on the prefill side first: wait for the decode
        # side to move too, still within the bound.
        dl = wait_value(lambda: {l["backend"] for n, l, v in prom(px.port)
                                 if n == "pdproxy_backend_up" and l.get("role") == "decode"},
                        lambda dl: dl == {"127.0.0.5:%d" % dport},
                        max(0.1, 2 * self.REFRESH + 0.5 - t))
        self.assertEqual(dl, {"127.0.0.5:%d" % dport}, "decode backends after the name moved")
        got = self.new_requests(P, D, 4)
        self.assertEqual(got, {"127.0.0.2": 0, "127.0.0.3": 4, "127.0.0.4": 0, "127.0.0.5": 4})
        self.assertTrue(D["127.0.0.5"].requests[-1].header("host").startswith("dnode.pdproxy-test"))

    def test_unresolvable_refresh_keeps_backends(self):
        """A name that stops resolving must not empty the pool (a DNS hiccup)."""
        P = self.track(same_port_mocks(["127.0.0.2"], lambda h: prefill_handler(), "P"))
        D = self.track(same_port_mocks(["127.0.0.4"], lambda h: decode_handler(), "D"))
        self.write_hosts(["127.0.0.2 pnode.pdproxy-test", "127.0.0.4 dnode.pdproxy-test"])
        self.px = px = self.start_ns(["--prefill", "http://pnode.pdproxy-test:%d"
                                      % P["127.0.0.2"].port,
                                      "--decode", "http://127.0.0.4:%d" % D["127.0.0.4"].port,
                                      "--dns-refresh", str(self.REFRESH)])
        self.assertEqual(healthcheck(px.port), (1, 1))
        # Gone from /etc/hosts: with files before dns in nsswitch.conf this
        # fails (or goes to a resolver that cannot answer for this name).
        since = len(px.stderr())
        self.write_hosts([])
        self.assertWarned(px, "cannot resolve", since=since, timeout=2 * self.REFRESH + 1)
        # Two more refreshes fail (one warning each) and the pool stays.
        fails = wait_value(lambda: px.stderr()[since:].count("cannot resolve"),
                           lambda n: n >= 3, 3 * self.REFRESH + 1)
        self.assertGreaterEqual(fails, 3, "refreshes after the name went away")
        self.assertEqual(healthcheck(px.port), (1, 1))
        got = self.new_requests(P, D, 2)
        self.assertEqual(got["127.0.0.2"], 2)


if __name__ == "__main__":
    unittest.main(verbosity=2)
