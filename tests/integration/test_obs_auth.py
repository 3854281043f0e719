#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""API keys (issue 6 item 5): with --api-key (or PDPROXY_API_KEY, or
--api-key-file with several keys) clients must send Authorization: Bearer
<key>, else 401 with an OpenAI-style error and nothing reaches P or D; the
health, readiness and metrics endpoints are exempt. What P and D receive:
--upstream-api-key, else the client's Authorization, else $OPENAI_API_KEY."""

import os
import tempfile

from pdharness.case import PxTestCase, main
from pdharness.client import RawClient, http_request, raw_exchange
from pdharness.mocks import chat_body, completion_body, decode_handler, prefill_handler
from pdharness.net import HOST, free_port
from pdharness.procs import run_pdproxy

KEY = "sk-pdproxy-Front-Key-0123456789"
KEYS_IN_FILE = ["sk-file-alpha-111", "sk-file-beta-222", "sk-file-gamma-333"]


class OnePairCase(PxTestCase):
    """A mock prefill P and decode D; start() runs pdproxy in front of them."""

    def setUp(self):
        super().setUp()
        self.P = self.mock(prefill_handler(), "P")
        self.D = self.mock(decode_handler(), "D")

    def start(self, extra=(), env=None):
        return self.start_proxy([self.P], [self.D], extra=["--drain-delay", "0"] + list(extra),
                                env=env)


class AuthTest(OnePairCase):

    def post(self, px, auth=None, path="/v1/completions", raw_auth=None):
        hs = []
        if auth is not None:
            hs.append(("Authorization", "Bearer %s" % auth))
        if raw_auth is not None:
            hs.append(("Authorization", raw_auth))
        body = chat_body() if "chat" in path else completion_body()
        return raw_exchange(px.port, "POST", path, body, headers=hs)

    def assertRefused(self, px, what, **kw):
        n_p, n_d = len(self.P.requests), len(self.D.requests)
        r = self.post(px, **kw)
        self.assertErrorJson(r, 401, what)
        self.assertEqual(len(self.P.requests), n_p, "%s: a refused request reached P" % what)
        self.assertEqual(len(self.D.requests), n_d, "%s: a refused request reached D" % what)
        return r

    def assertAccepted(self, px, what, **kw):
        r = self.post(px, **kw)
        self.assertEqual(r.status, 200, "%s: %r" % (what, r))
        return r

    def check_keys(self, px, good, bad):
        for k in good:
            self.assertAccepted(px, "key %r" % k, auth=k)
            self.assertAccepted(px, "key %r, chat" % k, auth=k, path="/v1/chat/completions")
        self.assertRefused(px, "no Authorization")
        for k in bad:
            self.assertRefused(px, "wrong key %r" % k, auth=k)
        self.assertRefused(px, "chat without a key", path="/v1/chat/completions")

    def common_bad(self, key):
        return ["", "x", key[:-1], key + "x", key.upper(), " " + key + "x", "Bearer " + key]

    def test_api_key_flag(self):
        px = self.start(["--api-key", KEY])
        self.check_keys(px, [KEY], self.common_bad(KEY))
        for raw in ("Basic " + KEY, KEY, "Bearer" + KEY, "Token " + KEY):
            self.assertRefused(px, "Authorization %r" % raw, raw_auth=raw)
        # The scheme name is case-insensitive (RFC 9110 11.1).
        self.assertAccepted(px, "lower-case scheme", raw_auth="bearer " + KEY)
        # /v1/models is an API endpoint too.
        r = raw_exchange(px.port, "GET", "/v1/models")
        self.assertErrorJson(r, 401, "GET /v1/models without a key")
        r = raw_exchange(px.port, "GET", "/v1/models", headers=[("Authorization", "Bearer " + KEY)])
        self.assertEqual(r.status, 200, r)

    def test_401_shape(self):
        px = self.start(["--api-key", KEY])
        r = self.assertRefused(px, "no Authorization")
        doc = r.json()
        self.assertEqual(doc["error"]["code"], 401)
        self.assertNotIn(KEY, bytes(r.raw).decode("latin-1"), "the key is echoed in the 401")
        r = self.assertRefused(px, "wrong key", auth="sk-guess-ABCDEF123")
        self.assertNotIn("sk-guess-ABCDEF123", bytes(r.raw).decode("latin-1"),
                         "the wrong key is echoed in the 401")
        self.assertEqual((r.header("www-authenticate") or "").split(" ")[0].lower(), "bearer",
                         "401 without WWW-Authenticate: Bearer (RFC 9110 11.6.1)")
        # The connection stays usable for a keyed request afterwards.
        c = RawClient(px.port)
        try:
            c.request("POST", "/v1/completions", completion_body())
            r1 = c.read_response()
            self.assertEqual(r1.status, 401)
            if not r1.eof:
                c.request("POST", "/v1/completions", completion_body(),
                          headers=[("Authorization", "Bearer " + KEY)])
                self.assertEqual(c.read_response().status, 200)
        finally:
            c.close()

    def test_env_key(self):
        px = self.start(env={"PDPROXY_API_KEY": KEY})
        self.check_keys(px, [KEY], self.common_bad(KEY))

    def test_api_key_file_several_keys(self):
        fd, path = tempfile.mkstemp(prefix="pdproxy-keys-")
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(KEYS_IN_FILE) + "\n")
        self.addCleanup(os.unlink, path)
        px = self.start(["--api-key-file", path])
        self.check_keys(px, KEYS_IN_FILE, ["sk-file-delta-444", KEYS_IN_FILE[0] + KEYS_IN_FILE[1],
                                           KEYS_IN_FILE[1][:-1]])

    def test_api_key_file_crlf_and_blank_lines(self):
        fd, path = tempfile.mkstemp(prefix="pdproxy-keys-")
        with os.fdopen(fd, "w", newline="") as f:
            f.write("\r\n".join([KEYS_IN_FILE[0], "", KEYS_IN_FILE[1]]) + "\r\n\r\n")
        self.addCleanup(os.unlink, path)
        px = self.start(["--api-key-file", path])
        self.check_keys(px, KEYS_IN_FILE[:2], [KEYS_IN_FILE[2], ""])

    def test_api_key_file_missing_refused_at_start(self):
        p = run_pdproxy(["--api-key-file", "/nonexistent/pdproxy-keys", "--host",
                         HOST, "--port", str(free_port())], timeout=10)
        self.assertNotEqual(p.returncode, 0, "pdproxy started without its key file")
        self.assertIn("api-key-file", p.stderr)

    def test_api_key_file_from_env(self):
        fd, path = tempfile.mkstemp(prefix="pdproxy-keys-")
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(KEYS_IN_FILE) + "\n")
        self.addCleanup(os.unlink, path)
        px = self.start(env={"PDPROXY_API_KEY_FILE": path})
        self.check_keys(px, KEYS_IN_FILE[1:], ["nope"])

    def test_exempt_endpoints(self):
        px = self.start(["--api-key", KEY])
        for path in ("/health", "/ready", "/metrics", "/healthcheck"):
            r = http_request(px.port, "GET", path)
            self.assertEqual(r.status, 200, "GET %s without a key: %r" % (path, r))
        self.assertEqual(http_request(px.port, "GET", "/metrics",
                                      headers={"Authorization": "Bearer wrong"}).status, 200)

    def test_no_key_configured_accepts_anything(self):
        px = self.start()
        self.assertAccepted(px, "no key configured, none sent")
        self.assertAccepted(px, "no key configured, one sent", auth="whatever")


class UpstreamAuthTest(OnePairCase):

    def sent(self, px, client_auth=None):
        n = len(self.P.requests)
        hs = [("Authorization", client_auth)] if client_auth else []
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(), headers=hs)
        self.assertEqual(r.status, 200, r)
        p = self.P.wait_requests(n + 1)[-1]
        d = self.D.wait_requests(n + 1)[-1]
        return p.header_all("authorization"), d.header_all("authorization")

    def test_upstream_api_key_wins(self):
        px = self.start(["--upstream-api-key", "U-key-1", "--api-key", KEY],
                        env={"OPENAI_API_KEY": "E-key-9"})
        p, d = self.sent(px, "Bearer " + KEY)
        self.assertEqual(p, ["Bearer U-key-1"], "P's Authorization")
        self.assertEqual(d, ["Bearer U-key-1"], "D's Authorization")

    def test_upstream_api_key_from_env(self):
        px = self.start(env={"PDPROXY_UPSTREAM_API_KEY": "U-key-2"})
        p, d = self.sent(px, "Bearer client-key")
        self.assertEqual((p, d), (["Bearer U-key-2"], ["Bearer U-key-2"]))
        p, d = self.sent(px)
        self.assertEqual((p, d), (["Bearer U-key-2"], ["Bearer U-key-2"]))

    def test_client_header_forwarded(self):
        px = self.start(env={"OPENAI_API_KEY": "E-key-9"})
        p, d = self.sent(px, "Bearer client-key-3")
        self.assertEqual((p, d), (["Bearer client-key-3"], ["Bearer client-key-3"]))

    def test_client_key_forwarded_with_front_auth(self):
        px = self.start(["--api-key", KEY])
        p, d = self.sent(px, "Bearer " + KEY)
        self.assertEqual((p, d), (["Bearer " + KEY], ["Bearer " + KEY]))

    def test_openai_api_key_env_fallback(self):
        px = self.start(env={"OPENAI_API_KEY": "E-key-9"})
        p, d = self.sent(px)
        self.assertEqual((p, d), (["Bearer E-key-9"], ["Bearer E-key-9"]))

    def test_nothing_sent_without_any_key(self):
        px = self.start()
        p, d = self.sent(px)
        self.assertEqual((p, d), ([], []))


if __name__ == "__main__":
    main()
