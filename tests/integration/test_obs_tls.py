#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""TLS (issue 6 item 4): --tls-cert/--tls-key serve HTTPS (TLS 1.2+ only) and
https:// backends are verified against --upstream-ca (or the system store, which
does not know the test CA), or not at all with --upstream-insecure. A throw-away
CA and certificates are made with the openssl CLI for each run."""

import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import unittest
import warnings

from pdharness.case import PxTestCase, main
from pdharness.client import http_request
from pdharness.mocks import (MockBackend, Respond, Stream, chat_body, completion_body,
                             prefill_handler, sse_events)
from pdharness.net import HOST, IO_TIMEOUT, free_port
from pdharness.procs import run_pdproxy

CERTS = {}


def _openssl(args, cwd):
    p = subprocess.run(["openssl"] + args, cwd=cwd, capture_output=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError("openssl %s failed: %s" % (" ".join(args), p.stderr.decode()[-2000:]))


def _leaf(d, name, san, ca="ca", ext=None):
    with open(os.path.join(d, name + ".ext"), "w") as f:
        f.write(ext or ("subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\n"
                        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n" % san))
    _openssl(["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
              "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=%s" % name], d)
    _openssl(["x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
              "-CAcreateserial", "-days", "2", "-out", name + ".pem", "-extfile", name + ".ext"], d)
    return os.path.join(d, name + ".pem"), os.path.join(d, name + ".key")


def setUpModule():
    if not shutil.which("openssl"):
        raise unittest.SkipTest("the openssl CLI is not installed")
    d = tempfile.mkdtemp(prefix="pdproxy-tls-")
    CERTS["dir"] = d
    _openssl(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
              "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
              "-subj", "/CN=pdproxy throw-away test CA",
              "-addext", "basicConstraints=critical,CA:TRUE",
              "-addext", "keyUsage=critical,keyCertSign,cRLSign"], d)
    CERTS["ca"] = os.path.join(d, "ca.pem")
    CERTS["server"] = _leaf(d, "server", "IP:127.0.0.1,DNS:localhost")
    CERTS["wronghost"] = _leaf(d, "wronghost", "DNS:wrong.example,IP:10.9.9.9")
    # A leaf under an intermediate CA; its --tls-cert file holds the chain.
    _leaf(d, "inter", None, ext="basicConstraints=critical,CA:TRUE,pathlen:0\n"
                                "keyUsage=critical,keyCertSign,cRLSign\n")
    leaf, key = _leaf(d, "chained", "IP:127.0.0.1", ca="inter")
    chain = os.path.join(d, "chain.pem")
    with open(chain, "w") as out, open(leaf) as a, open(os.path.join(d, "inter.pem")) as b:
        out.write(a.read() + b.read())
    CERTS["chain"] = (chain, key)
    # Client certificates (--tls-client-ca, --tenant-certs): two the test CA
    # issued, named by a URI and by the CN, one it issued that no line maps,
    # and one from a CA pdproxy does not trust.
    client = "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n" \
             "extendedKeyUsage=clientAuth\n"
    CERTS["c-alice"] = _leaf(d, "c-alice", None,
                             ext=client + "subjectAltName=URI:spiffe://example.org/alice\n")
    CERTS["c-bob"] = _leaf(d, "c-bob", None, ext=client + "subjectAltName=DNS:bob.example\n")
    CERTS["c-nobody"] = _leaf(d, "c-nobody", None, ext=client)
    _openssl(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
              "-nodes", "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "2",
              "-subj", "/CN=a CA pdproxy does not trust",
              "-addext", "basicConstraints=critical,CA:TRUE",
              "-addext", "keyUsage=critical,keyCertSign,cRLSign"], d)
    CERTS["c-rogue"] = _leaf(d, "c-rogue", None, ca="rogue",
                             ext=client + "subjectAltName=DNS:bob.example\n")


def tearDownModule():
    if CERTS.get("dir"):
        shutil.rmtree(CERTS["dir"], ignore_errors=True)


def server_ctx(which="server", min_version=None, max_version=None, seclevel0=False):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert, key = CERTS[which]
    ctx.load_cert_chain(cert, key)
    if seclevel0:
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    with warnings.catch_warnings():  # TLS 1.0/1.1 are deprecated: offering them is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        if min_version:
            ctx.minimum_version = min_version
        if max_version:
            ctx.maximum_version = max_version
    return ctx


def client_ctx(min_version=None, max_version=None, seclevel0=False):
    ctx = ssl.create_default_context(cafile=CERTS["ca"])
    if seclevel0:
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    with warnings.catch_warnings():  # TLS 1.0/1.1 are deprecated: offering them is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        if min_version:
            ctx.minimum_version = min_version
        if max_version:
            ctx.maximum_version = max_version
    return ctx


class TlsMock(MockBackend):
    """MockBackend speaking HTTPS: each accepted connection is wrapped with
    `ctx` before the usual serving. Failed handshakes are recorded, not errors."""

    def __init__(self, handler=None, name="tls", which="server"):
        self.ctx = server_ctx(which)
        self.handshakes_ok = 0
        self.handshake_errors = []
        super().__init__(handler, name=name)

    def _serve(self, conn):
        raw = conn.sock
        try:
            raw.settimeout(5.0)
            s = self.ctx.wrap_socket(raw, server_side=True)
            s.settimeout(None)
        except (ssl.SSLError, OSError) as e:
            self.handshake_errors.append(repr(e))
            conn.mark_peer_closed()
            try:
                raw.close()
            except OSError:
                pass
            return
        self.handshakes_ok += 1
        conn.sock = s
        MockBackend._serve(self, conn)


def https_request(port, method, path, body=None, headers=None, ctx=None, conn=None):
    """Returns (status, headers, body bytes, negotiated TLS version, peer cert)."""
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode("utf-8")
    hs = dict(headers or {})
    if body is not None:
        hs.setdefault("Content-Type", "application/json")
    c = conn or http.client.HTTPSConnection(HOST, port, timeout=IO_TIMEOUT,
                                            context=ctx or client_ctx())
    try:
        c.request(method, path, body=body, headers=hs)
        r = c.getresponse()
        data = r.read()
        return r.status, r.getheaders(), data, c.sock.version(), c.sock.getpeercert()
    finally:
        if conn is None:
            c.close()


def tls11_possible_locally():
    """Whether this machine's OpenSSL lets a client and a server negotiate
    TLS 1.1 at all (Debian's default security level forbids it)."""
    try:
        sctx = server_ctx(min_version=ssl.TLSVersion.TLSv1, max_version=ssl.TLSVersion.TLSv1_1,
                          seclevel0=True)
        cctx = client_ctx(min_version=ssl.TLSVersion.TLSv1, max_version=ssl.TLSVersion.TLSv1_1,
                          seclevel0=True)
    except (ssl.SSLError, ValueError):
        return False
    ls = socket.socket()
    ls.bind((HOST, 0))
    ls.listen(1)
    port = ls.getsockname()[1]
    result = {}

    def serve():
        try:
            ls.settimeout(5)
            s, _ = ls.accept()
            s.settimeout(5)
            with sctx.wrap_socket(s, server_side=True) as t:
                result["server"] = t.version()
        except Exception as e:
            result["server_err"] = repr(e)
    t = threading.Thread(target=serve)
    t.start()
    try:
        with socket.create_connection((HOST, port), timeout=5) as s:
            with cctx.wrap_socket(s, server_hostname=HOST) as c:
                result["client"] = c.version()
    except Exception as e:
        result["client_err"] = repr(e)
    t.join(6)
    ls.close()
    return result.get("client") == "TLSv1.1"


def p_handler():
    return prefill_handler()


D_BODY = b'{"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":"over tls"}]}'


def d_handler(req):
    if req.json().get("stream"):
        return Stream(200, [("Content-Type", "text/event-stream")],
                      [(0, e) for e in sse_events(["x", "y", "z"])])
    return Respond(200, [("Content-Type", "application/json")], D_BODY)


class TlsFrontTest(PxTestCase):

    def tls_proxy(self, prefill, decode, extra=()):
        cert, key = CERTS["server"]
        return self.start_proxy(prefill, decode, extra=["--drain-delay", "0", "--tls-cert", cert,
                                                        "--tls-key", key] + list(extra))

    def test_https_front_full_flow(self):
        P = self.mock(p_handler(), "P")
        D = self.mock(d_handler, "D")
        px = self.tls_proxy([P], [D])
        ctx = client_ctx()
        c = http.client.HTTPSConnection(HOST, px.port, timeout=IO_TIMEOUT, context=ctx)
        self.addCleanup(c.close)
        st, hs, body, ver, cert = https_request(px.port, "POST", "/v1/completions",
                                                completion_body(), conn=c)
        self.assertEqual(st, 200, body)
        self.assertEqual(body, D_BODY)
        self.assertIn(("IP Address", "127.0.0.1"), cert.get("subjectAltName", ()))
        self.assertIn(ver, ("TLSv1.2", "TLSv1.3"))
        # The same TLS connection again (keep-alive), a chat request.
        st, hs, body, _, _ = https_request(px.port, "POST", "/v1/chat/completions", chat_body(),
                                           conn=c)
        self.assertEqual(st, 200, body)
        self.assertEqual(len(P.requests), 2)
        self.assertEqual(len(D.requests), 2)
        self.assertEqual(P.requests[1].json()["max_tokens"], 1)
        # Streamed through TLS.
        st, hs, body, _, _ = https_request(px.port, "POST", "/v1/completions",
                                           completion_body(stream=True), conn=c)
        self.assertEqual(st, 200)
        self.assertEqual(body, b"".join(sse_events(["x", "y", "z"])))
        for path in ("/health", "/metrics", "/healthcheck"):
            st, _, body, _, _ = https_request(px.port, "GET", path, conn=c)
            self.assertEqual(st, 200, (path, body))

    def test_certificate_chain_file(self):
        # The client trusts the root only: the intermediate must come from pdproxy.
        P = self.mock(p_handler(), "P")
        D = self.mock(d_handler, "D")
        cert, key = CERTS["chain"]
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0", "--tls-cert", cert,
                                               "--tls-key", key])
        st, _, body, _, _ = https_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(st, 200, body)
        self.assertEqual(body, D_BODY)

    def test_tls12_and_tls13_accepted(self):
        P = self.mock(p_handler(), "P")
        D = self.mock(d_handler, "D")
        px = self.tls_proxy([P], [D])
        for v, name in ((ssl.TLSVersion.TLSv1_2, "TLSv1.2"), (ssl.TLSVersion.TLSv1_3, "TLSv1.3")):
            st, _, body, ver, _ = https_request(px.port, "GET", "/health",
                                                ctx=client_ctx(min_version=v, max_version=v))
            self.assertEqual(st, 200, body)
            self.assertEqual(ver, name)
        # Whatever the client offers, nothing below 1.2 is negotiated.
        st, _, _, ver, _ = https_request(
            px.port, "GET", "/health",
            ctx=client_ctx(min_version=ssl.TLSVersion.MINIMUM_SUPPORTED))
        self.assertEqual(st, 200)
        self.assertIn(ver, ("TLSv1.2", "TLSv1.3"))

    def test_tls11_refused(self):
        if not tls11_possible_locally():
            self.skipTest("this machine's OpenSSL cannot negotiate TLS 1.1 even with itself; "
                          "test_tls12_and_tls13_accepted checks the negotiated version instead")
        P = self.mock(p_handler(), "P")
        D = self.mock(d_handler, "D")
        px = self.tls_proxy([P], [D])
        ctx = client_ctx(min_version=ssl.TLSVersion.TLSv1, max_version=ssl.TLSVersion.TLSv1_1,
                         seclevel0=True)
        with self.assertRaises((ssl.SSLError, ConnectionError, OSError),
                               msg="pdproxy accepted a TLS 1.1 handshake"):
            https_request(px.port, "GET", "/health", ctx=ctx)

    def test_plain_http_to_tls_port_gets_no_http_answer(self):
        P = self.mock(p_handler(), "P")
        D = self.mock(d_handler, "D")
        px = self.tls_proxy([P], [D])
        s = socket.create_connection((HOST, px.port), timeout=5)
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            for _ in range(100):
                try:
                    chunk = s.recv(4096)
                except (ConnectionResetError, socket.timeout):
                    break
                if not chunk:
                    break
                data += chunk
        finally:
            s.close()
        self.assertFalse(data.startswith(b"HTTP/1.1 200"), data[:200])
        # And the server still serves TLS afterwards.
        self.assertEqual(https_request(px.port, "GET", "/health")[0], 200)

    def test_bad_key_refused_at_start(self):
        cert, _ = CERTS["server"]
        _, other_key = CERTS["wronghost"]
        p = run_pdproxy(["--tls-cert", cert, "--tls-key", other_key, "--host", HOST,
                         "--port", str(free_port()), "--health-interval", "0"],
                               timeout=10)
        self.assertNotEqual(p.returncode, 0, "pdproxy started with a key that is not the cert's")
        self.assertIn("tls-key", p.stderr)


class ClientCertTest(PxTestCase):
    """Issue 41 item 3: a tenant comes from credentials: an API key, a header
    a trusted gateway set, or a client certificate. --tls-client-ca verifies
    clients; --tenant-certs maps a certificate's name to a tenant."""

    def proxy(self, extra=(), certs="alice:spiffe://example.org/alice\nbob: c-bob \n"):
        self.P = self.mock(p_handler(), "P")
        self.D = self.mock(d_handler, "D")
        d = tempfile.mkdtemp(prefix="pdproxy-tcerts-")
        self.addCleanup(shutil.rmtree, d, True)
        tc, tk = os.path.join(d, "certs"), os.path.join(d, "keys")
        with open(tc, "w") as f:
            f.write("# tenant:certificate name\n" + certs)
        with open(tk, "w") as f:
            f.write("alice:sk-alice-key-1\n")
        cert, key = CERTS["server"]
        return self.start_proxy([self.P], [self.D], extra=[
            "--drain-delay", "0", "--tls-cert", cert, "--tls-key", key,
            "--tls-client-ca", CERTS["ca"], "--tenant-certs", tc, "--tenant-keys", tk,
            "--tenant", "alice:rpm=100 bob:rpm=2 default:rpm=100"] + list(extra))

    def post(self, px, who, headers=None):
        ctx = client_ctx()
        if who:
            ctx.load_cert_chain(*CERTS[who])
        body = {"model": "m", "prompt": "same prompt", "max_tokens": 2}
        st, _, data, _, _ = https_request(px.port, "POST", "/v1/completions", body,
                                          headers=headers, ctx=ctx)
        salt = self.P.requests[-1].json().get("cache_salt") if st == 200 else None
        return st, data, salt

    def test_certificate_names_the_tenant(self):
        px = self.proxy()
        st, body, alice = self.post(px, "c-alice")
        self.assertEqual(st, 200, body)
        self.assertRegex(alice, "^[0-9a-f]{32}$")
        # alice's key, over a connection whose certificate maps to no one:
        # the same tenant, so the same salt.
        st, body, by_key = self.post(px, "c-nobody", {"Authorization": "Bearer sk-alice-key-1"})
        self.assertEqual(st, 200, body)
        self.assertEqual(by_key, alice)
        # A tenant header is not a credential: alice stays alice.
        st, body, named = self.post(px, "c-alice", {"x-tenant": "bob"})
        self.assertEqual((st, named), (200, alice), body)
        # An unmapped certificate is the default tenant; bob (by his CN) is bob.
        _, _, anon = self.post(px, "c-nobody")
        st, body, bob = self.post(px, "c-bob")
        self.assertEqual(st, 200, body)
        self.assertEqual(len({alice, anon, bob}), 3)
        # bob's limit is bob's (rpm=2): his third request in the minute is
        # refused and names him; alice is still served.
        st, body, _ = self.post(px, "c-bob")
        self.assertEqual(st, 200, body)
        st, body, _ = self.post(px, "c-bob")
        self.assertEqual(st, 429, body)
        self.assertIn(b"bob", body)
        self.assertEqual(self.post(px, "c-alice")[0], 200)

    def test_handshake_needs_a_certificate_the_ca_issued(self):
        px = self.proxy()
        for who in (None, "c-rogue"):
            with self.assertRaises((ssl.SSLError, ConnectionError, OSError),
                                   msg="served a client with %s" % (who or "no certificate")):
                self.post(px, who)
        self.assertEqual(len(self.P.requests), 0)
        self.assertEqual(self.post(px, "c-alice")[0], 200)

    def test_optional_serves_clients_without_one(self):
        px = self.proxy(["--tls-client-verify", "optional"])
        st, body, anon = self.post(px, None)
        self.assertEqual(st, 200, body)
        _, _, alice = self.post(px, "c-alice")
        self.assertNotEqual(anon, alice)
        # A certificate the CA did not issue still fails the handshake.
        with self.assertRaises((ssl.SSLError, ConnectionError, OSError)):
            self.post(px, "c-rogue")

    def test_settings_checked_at_start(self):
        cert, key = CERTS["server"]
        d = tempfile.mkdtemp(prefix="pdproxy-tcerts-")
        self.addCleanup(shutil.rmtree, d, True)
        bad = os.path.join(d, "bad")
        with open(bad, "w") as f:
            f.write("alice:c-alice\nno tenant here\n")
        twice = os.path.join(d, "twice")
        with open(twice, "w") as f:
            f.write("alice:c-alice\nbob:c-alice\n")
        base = ["--host", HOST, "--port", str(free_port()), "--health-interval", "0",
                "--decode", "http://127.0.0.1:9"]
        cases = [
            (["--tls-client-ca", CERTS["ca"]], "--tls-cert"),
            (["--tls-cert", cert, "--tls-key", key, "--tenant-certs", bad], "--tls-client-ca"),
            (["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", CERTS["ca"],
              "--tenant-certs", bad], "line 2"),
            (["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", CERTS["ca"],
              "--tenant-certs", twice], "another tenant"),
            (["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", bad], "--tls-client-ca"),
        ]
        for args, said in cases:
            p = run_pdproxy(base + args, timeout=10)
            self.assertEqual(p.returncode, 2, (args, p.stderr))
            self.assertIn(said, p.stderr, args)


class TlsUpstreamTest(PxTestCase):

    def tls_mocks(self, which="server"):
        P = TlsMock(p_handler(), name="P-tls", which=which)
        D = TlsMock(d_handler, name="D-tls", which=which)
        for m in (P, D):
            self._mocks.append(m)
            self.addCleanup(self._stop_mock, m)
        return P, D

    def start(self, P, D, extra=()):
        args = ["--prefill", "https://127.0.0.1:%d" % P.port,
                "--decode", "https://127.0.0.1:%d" % D.port, "--drain-delay", "0"] + list(extra)
        return self.start_proxy(args=args)

    def post(self, px, body=None):
        return http_request(px.port, "POST", "/v1/completions", body or completion_body())

    def test_verified_with_upstream_ca(self):
        P, D = self.tls_mocks()
        px = self.start(P, D, ["--upstream-ca", CERTS["ca"], "--health-interval", "0.2"])
        r = self.post(px)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.body, D_BODY)
        self.assertEqual(len(P.requests), 1)
        self.assertEqual(len(D.requests), 1)
        self.assertEqual(P.requests[0].json()["kv_transfer_params"]["do_remote_decode"], True)
        self.assertIn("kv_transfer_params", D.requests[0].json())
        self.assertGreater(P.handshakes_ok, 0)
        # Health checks go over TLS too, verified the same way.
        self.assertGreaterEqual(P.wait_probes(1, 5), 1, "no health check reached the https P")
        r = http_request(px.port, "GET", "/ready")
        self.assertEqual(r.status, 200, r)
        # Streaming from an https D.
        r = self.post(px, completion_body(stream=True))
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.body, b"".join(sse_events(["x", "y", "z"])))

    def test_unknown_ca_is_502(self):
        P, D = self.tls_mocks()
        px = self.start(P, D, ["--health-interval", "0"])
        r = self.post(px)
        self.assertErrorJson(r, 502, "https prefill whose CA pdproxy does not know:")
        self.assertEqual(P.requests, [], "a request reached P over an unverified connection")
        self.assertEqual(D.requests, [])
        self.assertTrue(P.handshake_errors, "P saw no refused handshake")

    def test_hostname_mismatch_is_502(self):
        P, D = self.tls_mocks(which="wronghost")
        px = self.start(P, D, ["--upstream-ca", CERTS["ca"], "--health-interval", "0"])
        r = self.post(px)
        self.assertErrorJson(r, 502, "https prefill whose certificate names another host:")
        self.assertEqual(P.requests, [])
        self.assertEqual(D.requests, [])

    def test_insecure_skips_verification(self):
        for which in ("server", "wronghost"):
            P, D = self.tls_mocks(which=which)
            px = self.start(P, D, ["--upstream-insecure", "--health-interval", "0"])
            r = self.post(px)
            self.assertEqual(r.status, 200, (which, r))
            self.assertEqual(r.body, D_BODY)
            self.assertEqual(len(P.requests), 1)
            self.assertEqual(len(D.requests), 1)

    def test_https_front_and_backends(self):
        P, D = self.tls_mocks()
        cert, key = CERTS["server"]
        px = self.start(P, D, ["--upstream-ca", CERTS["ca"], "--tls-cert", cert, "--tls-key", key])
        st, _, body, ver, _ = https_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(st, 200, body)
        self.assertEqual(body, D_BODY)
        self.assertEqual(len(P.requests), 1)
        self.assertEqual(len(D.requests), 1)


if __name__ == "__main__":
    main()
