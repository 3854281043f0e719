#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Sidecar mode for llm-d: with --prefiller-from-header the prefill is the
instance x-prefiller-host-port names (of several, the first), only when its
host is in --prefiller-allowlist; without the header, decode alone. A header
outside the allowlist is refused with 400 and reaches no backend."""

import json
import os
import tempfile
import unittest

from pdharness.client import errmsg, http_request
from pdharness.ctl import url
from pdharness.mocks import decode_handler, prefill_handler
from pdharness.logs import parse_logfmt
from pdharness.net import wait_until
from pdharness.procs import run_pdproxy
from pdharness.prom import prom
from pdharness.prod import ProdCase


class SidecarTest(ProdCase):
    def sidecar(self, allow="127.0.0.1/32:*"):
        self.D = self.mock(decode_handler(), name="D")
        # A configured prefill that the header mode must not fall back to.
        self.Pcfg = self.mock(prefill_handler(), name="Pcfg")
        return self.start(args=["--prefill", url(self.Pcfg), "--decode", url(self.D),
                                "--prefiller-from-header", "--prefiller-allowlist", allow])

    def hp(self, m):
        return "127.0.0.1:%d" % m.port

    def test_header_outside_allowlist_refused_before_any_backend(self):
        P = self.mock(prefill_handler(), name="P")
        px = self.sidecar(allow="10.0.0.0/8:*,prefill.example:*")
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
        px = self.sidecar(allow="127.0.0.1/32:*,localhost:*")
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
        p = run_pdproxy(["--prefiller-from-header", "--prefiller-allowlist", "10.0.0.0/33:*",
                         "--print-config"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("not a CIDR", p.stderr)


    # --- no phantom prefill (issue 27 item 6) ---------------------------------

    def access(self, px, rid):
        """The access record of request id `rid` (waits for it)."""
        def mine():
            return [parse_logfmt(l) for l in px.stderr().splitlines()
                    if 'msg="request"' in l and "total_ms=" in l and ("req=%s " % rid) in l]
        wait_until(lambda: mine(), 5.0, 0.02)
        recs = mine()
        self.assertEqual(len(recs), 1, recs)
        return recs[0]

    def test_decode_only_sidecar_has_no_phantom_prefill(self):
        """The manifest's sidecar passes only --decode: the toy default
        localhost:8100 must not become a prefill backend (it would be
        ejected and show as an outage on the dashboard)."""
        D = self.mock(decode_handler(), name="D")
        px = self.start(args=["--decode", url(D), "--prefiller-from-header",
                              "--prefiller-allowlist", "127.0.0.1/32:*"], health_interval="1")
        samples = prom(px.port)
        roles = sorted({l.get("role") for n, l, v in samples if n == "pdproxy_backend_up"})
        self.assertEqual(roles, ["decode"], [s for s in samples if s[0] == "pdproxy_backend_up"])
        self.assertNotIn(":8100", px.stderr())
        r = http_request(px.port, "GET", "/ready")
        self.assertEqual(r.status, 200, r.body)
        r = http_request(px.port, "GET", "/healthcheck")
        self.assertEqual(json.loads(r.body)["prefill_instances"], 0, r.body)

    def test_no_toy_default_beside_urls_or_a_file(self):
        """--decode alone, --prefill alone, or a file naming backends: the
        other role's toy default does not apply."""
        for args, absent in ((["--decode", "http://127.0.0.1:9"], "prefiller-hosts"),
                             (["--prefill", "http://127.0.0.1:9"], "decoder-hosts")):
            with self.subTest(args=args):
                p = run_pdproxy(args + ["--print-config"])
                self.assertEqual(p.returncode, 0, p.stderr)
                self.assertNotIn(absent, p.stdout)
                self.assertNotIn("localhost", p.stdout)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write("decode: [http://127.0.0.1:9]\n")
        self.addCleanup(os.unlink, f.name)
        p = run_pdproxy(["--config", f.name, "--print-config"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertNotIn("prefiller-hosts", p.stdout)
        # The toy flags alone keep the toy proxy's defaults for the other role.
        p = run_pdproxy(["--prefiller-hosts", "10.0.0.1", "--print-config"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("decoder-hosts", p.stdout)

    def test_no_header_is_logged_and_counted_as_decode_only(self):
        px = self.sidecar()
        r = self.post(px, headers={"X-Request-Id": "no-header-1"})
        self.assertEqual(r.status, 200, r.body)
        rec = self.access(px, "no-header-1")
        self.assertEqual(rec.get("decision"), "decode_only", rec)
        self.assertEqual(rec.get("decision_reason"), "no_prefiller_header", rec)
        self.assertNotIn("prefill", rec)
        samples = prom(px.port)
        got = {(l.get("decision"), l.get("reason")): v for n, l, v in samples
               if n == "pdproxy_disagg_decisions_total" and v}
        self.assertEqual(got, {("decode_only", "no_prefiller_header"): 1}, got)
        # With the header, disaggregated as before.
        r = self.post(px, headers={"X-Request-Id": "with-header-1",
                                   "x-prefiller-host-port": self.hp(self.Pcfg)})
        self.assertEqual(r.status, 200, r.body)
        rec = self.access(px, "with-header-1")
        self.assertEqual(rec.get("decision"), "disaggregated", rec)

if __name__ == "__main__":
    unittest.main(verbosity=2)
