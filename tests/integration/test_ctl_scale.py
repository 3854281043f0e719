#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The control plane with thousands of backends (issue 30, item 3): one
admin API add or remove applies in place, without a rebuild of every pool,
and keeps every guarantee a rebuild gives (one spelling per backend, no
backend that is the proxy itself, no pool left without a role it needs),
the members and the answers exactly those of the change. These tests assert
membership and answers, never durations (bench/control_plane.py measures)."""

import os
import unittest

from pdharness.ctl import admin, pools_yaml, tmpdir, token_file, url, write_yaml
from pdharness.mocks import completion_body, decode_handler, prefill_handler
from pdharness.net import HOST, free_port
from pdharness.procs import ProxyStartError
from pdharness.prod import ProdCase

N = 2000  # backends of the big pool: half prefill, half decode


def addr(i):
    return "127.%d.%d.%d" % (1 + (i >> 16) % 250, (i >> 8) & 255, i & 255)


def big_urls(n, shift=0, port=9):
    half = n // 2
    return (["http://%s:%d" % (addr(i + shift), port) for i in range(half)],
            ["http://%s:%d" % (addr(i + shift + 500000), port) for i in range(n - half)])


class ScaleAdminTest(ProdCase):
    def setUp(self):
        super().setUp()
        self.dir = tmpdir(self)
        self.tokpath, self.token = token_file(self, self.dir)
        self.file = os.path.join(self.dir, "pdproxy.yaml")

    def start_admin(self, text, extra=()):
        write_yaml(self.file, text)
        for _ in range(3):
            self.aport = free_port()
            try:
                return self.start(args=["--config", self.file, "--admin-port", str(self.aport),
                                        "--admin-token-file", self.tokpath] + list(extra))
            except ProxyStartError as e:
                if "admin" not in str(e):
                    raise
        raise AssertionError("no free admin port")

    def call(self, method, path, body=None):
        return admin(self.aport, method, path, body, self.token)

    def members(self, pool):
        st, doc = self.call("GET", "/admin/backends")
        self.assertEqual(st, 200, doc)
        return doc["generation"], {(b["role"], b["url"]) for b in doc["backends"]
                                   if b["pool"] == pool}

    def test_changes_in_place_at_2000_backends(self):
        P = self.mock(prefill_handler(), "p")
        D1 = self.mock(decode_handler(), "d1")
        D2 = self.mock(decode_handler(), "d2")
        pre, dec = big_urls(N)
        px = self.start_admin(pools_yaml([("big", ["big"], pre, dec), ("m", ["m"], [P], [D1])]),
                              extra=["--prefill-policy", "prefix_affinity",
                                     "--decode-policy", "prefix_affinity"])
        gen, have = self.members("big")
        want = {("prefill", u) for u in pre} | {("decode", u) for u in dec}
        self.assertEqual(have, want)

        # Adds, one at a time: each a generation of its own, each listed.
        new = ["http://%s:9" % addr(900000 + i) for i in range(40)]
        for i, u in enumerate(new):
            st, doc = self.call("POST", "/admin/backends", {"pool": "big", "role": "decode",
                                                            "url": u})
            self.assertEqual(st, 201, doc)
            self.assertEqual(doc["generation"], gen + i + 1)
        want |= {("decode", u) for u in new}
        # Removes of the file's backends, first and last included.
        gone = [pre[0], pre[-1]] + pre[100:130]
        for u in gone:
            st, doc = self.call("DELETE", "/admin/backends", {"pool": "big", "role": "prefill",
                                                              "url": u})
            self.assertEqual(st, 200, (u, doc))
        want -= {("prefill", u) for u in gone}
        g2, have = self.members("big")
        self.assertEqual(g2, gen + len(new) + len(gone))
        self.assertEqual(have, want)

        # Refused, and nothing changes: another spelling of a member (409 or
        # 400), a member of the other role is no member of this one (404),
        # removed twice (404), this proxy itself (400), a pool not there.
        for u in (new[0] + "/", "http://[::ffff:%s]:9" % addr(900000), dec[5] + "/",
                  "http://%s:9" % addr(500005)):
            st, doc = self.call("POST", "/admin/backends", {"pool": "big", "role": "decode",
                                                            "url": u})
            self.assertIn(st, (400, 409), (u, doc))
        st, doc = self.call("DELETE", "/admin/backends", {"pool": "big", "role": "prefill",
                                                          "url": new[1]})
        self.assertEqual(st, 404, doc)
        self.assertIn("is not a prefill backend", doc["error"]["message"])
        st, doc = self.call("DELETE", "/admin/backends", {"pool": "big", "role": "prefill",
                                                          "url": gone[0]})
        self.assertEqual(st, 404, doc)
        st, doc = self.call("POST", "/admin/backends",
                            {"pool": "big", "role": "prefill",
                             "url": "http://%s:%d" % (HOST, px.port)})
        self.assertEqual(st, 400, doc)
        self.assertIn("own listen address", doc["error"]["message"])
        st, doc = self.call("POST", "/admin/backends", {"pool": "zz", "role": "decode",
                                                        "url": new[0]})
        self.assertEqual(st, 404, doc)
        # A backend removed can come back, in another spelling.
        st, doc = self.call("POST", "/admin/backends", {"pool": "big", "role": "prefill",
                                                        "url": gone[2] + "/"})
        self.assertEqual(st, 201, doc)
        st, doc = self.call("DELETE", "/admin/backends", {"pool": "big", "role": "prefill",
                                                          "url": gone[2]})
        self.assertEqual(st, 200, doc)
        g3, have = self.members("big")
        self.assertEqual(g3, g2 + 2)
        self.assertEqual(have, want)

        # Traffic follows the changes of pool m: D2 in, D1 out; the last
        # decode backend cannot go (the pool would be left without one).
        self.assertEqual(self.post(px, completion_body(model="m")).status, 200)
        self.assertEqual(len(D1.requests), 1)
        st, doc = self.call("POST", "/admin/backends", {"pool": "m", "role": "decode",
                                                        "url": url(D2)})
        self.assertEqual(st, 201, doc)
        st, doc = self.call("DELETE", "/admin/backends", {"pool": "m", "role": "decode",
                                                          "url": url(D1)})
        self.assertEqual(st, 200, doc)
        st, doc = self.call("DELETE", "/admin/backends", {"pool": "m", "role": "decode",
                                                          "url": url(D2)})
        self.assertEqual(st, 400, doc)
        self.assertIn("has no decode backend", doc["error"]["message"])
        for i in range(4):
            r = self.post(px, completion_body(model="m", prompt="prompt %d" % i))
            self.assertEqual(r.status, 200)
        self.assertEqual(len(D1.requests), 1)
        self.assertEqual(len(D2.requests), 4)
        self.assertIn("in_place=1", px.stderr(), "the changes took the in-place path")

        # The API's changes are remembered in order, and a reload from the
        # file drops them: the file's members, exactly.
        st, doc = self.call("GET", "/admin/config")
        self.assertEqual(len(doc["api_changes"]), len(new) + len(gone) + 4)
        st, doc = self.call("POST", "/admin/reload")
        self.assertEqual(st, 200, doc)
        _, have = self.members("big")
        self.assertEqual(have, {("prefill", u) for u in pre} | {("decode", u) for u in dec})
        _, have = self.members("m")
        self.assertEqual(have, {("prefill", url(P)), ("decode", url(D1))})
        self.assertEqual(self.post(px, completion_body(model="m")).status, 200)
        self.assertEqual(len(D1.requests), 2)

    def test_changes_after_in_place_ones_rebuild_consistently(self):
        """A change that needs a rebuild (a host name) after changes made in
        place: the rebuilt generation has all of them, and the next in-place
        change still knows every member."""
        P = self.mock(prefill_handler(), "p")
        D1 = self.mock(decode_handler(), "d1")
        D2 = self.mock(decode_handler(), "d2")
        px = self.start_admin(pools_yaml([("m", ["m"], [P], [D1])]))
        st, doc = self.call("POST", "/admin/backends", {"pool": "m", "role": "decode",
                                                        "url": url(D2)})
        self.assertEqual(st, 201, doc)
        st, doc = self.call("POST", "/admin/backends", {"pool": "m", "role": "prefill",
                                                        "url": "http://localhost:9"})
        self.assertEqual(st, 201, doc)
        _, have = self.members("m")
        self.assertEqual(have, {("prefill", url(P)), ("prefill", "http://localhost:9"),
                                ("decode", url(D1)), ("decode", url(D2))})
        st, doc = self.call("POST", "/admin/backends", {"pool": "m", "role": "decode",
                                                        "url": url(D2) + "/"})
        self.assertEqual(st, 409, doc)
        st, doc = self.call("POST", "/admin/backends", {"pool": "m", "role": "prefill",
                                                        "url": "http://127.0.0.1:9"})
        self.assertEqual(st, 409, doc)
        st, doc = self.call("DELETE", "/admin/backends", {"pool": "m", "role": "prefill",
                                                          "url": "http://127.0.0.1:9"})
        self.assertEqual(st, 200, doc)
        st, doc = self.call("DELETE", "/admin/backends", {"pool": "m", "role": "decode",
                                                          "url": url(D1)})
        self.assertEqual(st, 200, doc)
        _, have = self.members("m")
        self.assertEqual(have, {("prefill", url(P)), ("decode", url(D2))})
        self.assertEqual(self.post(px, completion_body(model="m")).status, 200)
        self.assertEqual((len(D1.requests), len(D2.requests)), (0, 1))


if __name__ == "__main__":
    unittest.main()
