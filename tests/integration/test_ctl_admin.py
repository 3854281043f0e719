#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The admin API: its own listener, every call authenticated with the token
of --admin-token-file (never the client API key); backends listed, added,
removed, drained and undrained; the configuration shown; the file reloaded.
Changes made through it last until the next reload from the file."""

import os
import unittest

from pdharness.client import http_request
from pdharness.ctl import url, write_yaml
from pdharness.mocks import decode_handler, prefill_handler
from pdharness.net import free_port
from pdharness.procs import run_pdproxy
from pdharness.prod import AdminCase


class AdminTest(AdminCase):
    def test_every_call_needs_the_admin_token(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_admin([("m", ["m"], [P], [D])], extra=["--api-key", "client-key-1"])
        for method, path in (("GET", "/admin/backends"), ("POST", "/admin/reload"),
                             ("GET", "/admin/config"), ("DELETE", "/admin/backends"),
                             ("POST", "/admin/backends/drain")):
            for tok in (None, "wrong-token-wrong-token", "client-key-1"):
                with self.subTest(method=method, path=path, token=tok):
                    st, doc = self.call(method, path, {"url": url(D), "role": "decode",
                                                       "pool": "m"}, token=tok)
                    self.assertEqual(st, 401)
                    self.assertEqual(doc["error"]["type"], "authentication_error")
        self.assertIn("admin call refused", px.stderr())
        # Nothing changed: D still serves.
        self.assertEqual(self.post(px, headers={"Authorization": "Bearer client-key-1"}).status,
                         200)
        # The admin API is not on the client port.
        r = http_request(px.port, "GET", "/admin/backends",
                         headers={"Authorization": "Bearer " + self.token})
        self.assertEqual(r.status, 404)

    def test_admin_port_needs_a_token_file(self):
        p = run_pdproxy(["--admin-port", "9999", "--print-config"])
        self.assertEqual(p.returncode, 2)
        self.assertIn("--admin-token-file", p.stderr)
        short = os.path.join(self.dir, "short.token")
        with open(short, "w") as f:
            f.write("abc\n")
        p = run_pdproxy(["--admin-port", str(free_port()), "--admin-token-file", short,
                         "--port", str(free_port())])
        self.assertEqual(p.returncode, 2)
        self.assertIn("16 to 1023 visible ASCII characters", p.stderr)

    def test_list_add_remove_backends(self):
        P = self.mock(prefill_handler(), name="P")
        D1 = self.mock(decode_handler(), name="D1")
        D2 = self.mock(decode_handler(), name="D2")
        px = self.start_admin([("m", ["m"], [P], [D1])])
        st, doc = self.call("GET", "/admin/backends")
        self.assertEqual(st, 200)
        rows = {(b["role"], b["backend"]): b for b in doc["backends"]}
        self.assertEqual(set(rows), {("prefill", self.bname(P)), ("decode", self.bname(D1))})
        b = rows[("decode", self.bname(D1))]
        for k in ("pool", "url", "healthy", "inflight", "ejected", "drained", "requests"):
            self.assertIn(k, b)
        self.assertEqual(b["pool"], "m")
        self.assertIn("until the next reload", doc["note"])
        # Add D2, remove D1: traffic moves.
        st, doc = self.call("POST", "/admin/backends", {"pool": "m", "role": "decode",
                                                        "url": url(D2)})
        self.assertEqual(st, 201, doc)
        self.assertIn("until the next reload", doc["note"])
        st, doc = self.call("DELETE", "/admin/backends", {"pool": "m", "role": "decode",
                                                          "url": url(D1)})
        self.assertEqual(st, 200, doc)
        for _ in range(3):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual(len(D1.requests), 0)
        self.assertEqual(len(D2.requests), 3)
        self.assertIn("admin: backend added", px.stderr())
        self.assertIn("who=token:", px.stderr())
        # Errors: a backend the pool does not have 404 (nothing changes),
        # unknown pool 404, duplicate 409, bad URL and body 400.
        st, doc = self.call("DELETE", "/admin/backends", {"pool": "m", "role": "decode",
                                                          "url": url(D1)})
        self.assertEqual(st, 404, doc)
        self.assertIn("is not a decode backend", doc["error"]["message"])
        self.assertEqual(self.post(px).status, 200)
        self.assertEqual(len(D2.requests), 4)
        st, doc = self.call("POST", "/admin/backends", {"pool": "zz", "role": "decode",
                                                        "url": url(D1)})
        self.assertEqual(st, 404, doc)
        st, doc = self.call("POST", "/admin/backends", {"pool": "m", "role": "decode",
                                                        "url": url(D2)})
        self.assertEqual(st, 409, doc)
        st, doc = self.call("POST", "/admin/backends", {"pool": "m", "role": "decode",
                                                        "url": "ftp://x"})
        self.assertEqual(st, 400, doc)
        st, doc = self.call("POST", "/admin/backends", {"role": "middle", "url": url(D2)})
        self.assertEqual(st, 400, doc)
        self.assertIn("message", doc["error"])
        # The config shows the API's changes; a reload from the file drops them.
        st, doc = self.call("GET", "/admin/config")
        self.assertEqual(st, 200)
        self.assertEqual([c["op"] for c in doc["api_changes"]], ["add", "remove"])
        st, doc = self.call("POST", "/admin/reload")
        self.assertEqual(st, 200, doc)
        st, doc = self.call("GET", "/admin/config")
        self.assertEqual(doc["api_changes"], [])
        self.assertEqual(self.post(px).status, 200)
        self.assertEqual(len(D1.requests), 1, "the file's backend is back after a reload")

    def test_drain_and_undrain(self):
        P = self.mock(prefill_handler(), name="P")
        D1 = self.mock(decode_handler(), name="D1")
        D2 = self.mock(decode_handler(), name="D2")
        px = self.start_admin([("m", ["m"], [P], [D1, D2])])
        st, doc = self.call("POST", "/admin/backends/drain", {"backend": self.bname(D1)})
        self.assertEqual(st, 200, doc)
        self.assertTrue(doc["backends"][0]["drained"])
        for _ in range(4):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual(len(D1.requests), 0, "a drained backend got a new request")
        self.assertEqual(len(D2.requests), 4)
        st, doc = self.call("POST", "/admin/backends/undrain", {"url": url(D1)})
        self.assertEqual(st, 200, doc)
        for _ in range(4):
            self.assertEqual(self.post(px).status, 200)
        self.assertGreater(len(D1.requests), 0)
        st, doc = self.call("POST", "/admin/backends/drain", {"backend": "10.9.9.9:1"})
        self.assertEqual(st, 404)
        # Draining every decode: ready turns 503 and requests get 503 at once.
        for m in (D1, D2):
            self.call("POST", "/admin/backends/drain", {"backend": self.bname(m)})
        self.assertEqual(http_request(px.port, "GET", "/ready").status, 503)
        n = len(P.requests)
        self.assertEqual(self.post(px).status, 503)
        self.assertEqual(len(P.requests), n)

    def test_reload_with_a_bad_file_says_why(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_admin([("m", ["m"], [P], [D])])
        write_yaml(self.file, "pools:\n  - name: m\n    decode: [http://127.0.0.1:1]\n"
                              "  - oops\n")
        st, doc = self.call("POST", "/admin/reload")
        self.assertEqual(st, 400, doc)
        self.assertIn(self.file + ":4:", doc["error"]["message"])
        st, doc = self.call("GET", "/admin/backends")
        self.assertEqual(doc["generation"], 1)
        self.assertEqual(self.post(px).status, 200)
        st, doc = self.call("GET", "/admin/nothing")
        self.assertEqual(st, 404)
        st, doc = self.call("PUT", "/admin/reload")
        self.assertEqual(st, 405)


if __name__ == "__main__":
    unittest.main(verbosity=2)
