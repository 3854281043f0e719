#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Sidecar mode for llm-d: with --prefiller-from-header the prefill is the
instance x-prefiller-host-port names (of several, the first), only when its
host is in --prefiller-allowlist; without the header, decode alone. A header
outside the allowlist is refused with 400 and reaches no backend."""

import json
import unittest

from pdharness.client import errmsg
from pdharness.ctl import url
from pdharness.mocks import decode_handler, prefill_handler
from pdharness.procs import run_pdproxy
from pdharness.prod import ProdCase


class SidecarTest(ProdCase):
    def sidecar(self, allow="127.0.0.1/32"):
        self.D = self.mock(decode_handler(), name="D")
        # A configured prefill that the header mode must not fall back to.
        self.Pcfg = self.mock(prefill_handler(), name="Pcfg")
        return self.start(args=["--prefill", url(self.Pcfg), "--decode", url(self.D),
                                "--prefiller-from-header", "--prefiller-allowlist", allow])

    def hp(self, m):
        return "127.0.0.1:%d" % m.port

    def test_header_outside_allowlist_refused_before_any_backend(self):
        P = self.mock(prefill_handler(), name="P")
        px = self.sidecar(allow="10.0.0.0/8,prefill.example")
        for value in (self.hp(P), "169.254.169.254:80", "localhost:%d" % P.port,
                      "[::1]:%d" % P.port):
            with self.subTest(header=value):
                r = self.post(px, headers={"x-prefiller-host-port": value})
                self.assertEqual(r.status, 400, r.body)
                self.assertIn("not an allowed prefill target", errmsg(r))
                self.assertEqual(json.loads(bytes(r.body))["error"]["type"],
                                 "invalid_request_error")
        for m in (P, self.Pcfg, self.D):
            self.assertEqual(len(m.requests), 0, "a refused request reached a backend")
        self.assertIn("outside --prefiller-allowlist", px.stderr())

    def test_header_in_allowlist_prefills_there(self):
        P = self.mock(prefill_handler(), name="P")
        px = self.sidecar()
        r = self.post(px, headers={"x-prefiller-host-port": self.hp(P)})
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(P.requests), 1)
        self.assertEqual(len(self.Pcfg.requests), 0)
        self.assertEqual(len(self.D.requests), 1)
        self.assertIn("kv_transfer_params", self.D.requests[0].json())

    def test_allowed_name_not_resolved_on_the_request_path(self):
        # An allowed host name that is not a configured prefill would need
        # DNS on the worker's loop: refused, reaching no backend.
        P = self.mock(prefill_handler(), name="P")
        px = self.sidecar(allow="127.0.0.1/32,localhost")
        r = self.post(px, headers={"x-prefiller-host-port": "localhost:%d" % P.port})
        self.assertEqual(r.status, 400, r.body)
        self.assertIn("IP address", errmsg(r))
        for m in (P, self.Pcfg, self.D):
            self.assertEqual(len(m.requests), 0, "a refused request reached a backend")

    def test_several_prefillers_first_counts(self):
        P1 = self.mock(prefill_handler(), name="P1")
        P2 = self.mock(prefill_handler(), name="P2")
        px = self.sidecar()
        r = self.post(px, headers={"x-prefiller-host-port": "%s, %s" % (self.hp(P1),
                                                                        self.hp(P2))})
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual((len(P1.requests), len(P2.requests)), (1, 0))

    def test_no_header_decodes_alone(self):
        px = self.sidecar()
        r = self.post(px)
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(self.Pcfg.requests), 0)
        self.assertEqual(len(self.D.requests), 1)
        self.assertNotIn("kv_transfer_params", self.D.requests[0].json())

    def test_malformed_header_400(self):
        px = self.sidecar()
        for value in ("127.0.0.1", "127.0.0.1:0", "127.0.0.1:99999", "http://127.0.0.1:1/x",
                      ":80"):
            with self.subTest(header=value):
                r = self.post(px, headers={"x-prefiller-host-port": value})
                self.assertEqual(r.status, 400, r.body)
        self.assertEqual(len(self.D.requests), 0)

    def test_header_ignored_without_the_flag(self):
        P = self.mock(prefill_handler(), name="P")
        Pcfg = self.mock(prefill_handler(), name="Pcfg")
        D = self.mock(decode_handler(), name="D")
        px = self.start([Pcfg], [D])
        self.assertEqual(self.post(px, headers={"x-prefiller-host-port": self.hp(P)}).status, 200)
        self.assertEqual((len(P.requests), len(Pcfg.requests)), (0, 1))

    def test_flag_needs_an_allowlist(self):
        p = run_pdproxy(["--prefiller-from-header", "--print-config"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("--prefiller-allowlist", p.stderr)
        p = run_pdproxy(["--prefiller-from-header", "--prefiller-allowlist", "10.0.0.0/33",
                         "--print-config"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("not a CIDR", p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
