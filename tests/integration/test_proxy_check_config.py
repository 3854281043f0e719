#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""--check-config: a dry run of start-up.  Everything start-up refuses (files
that cannot be read, certificates and keys that do not load, a backend that
is pdproxy itself, a port in use, a listen host that does not resolve) is
refused with exit 2 and the reason, and a configuration that would start
answers 0, with no listener opened and no request served.  --print-config
stays a dump.  TLS errors name the cause (they printed "(null)")."""

import os
import socket
import subprocess
import tempfile

from pdharness.case import PxTestCase, main
from pdharness.net import HOST, free_port
from pdharness.procs import run_pdproxy


def pem_pair(d, name):
    key, cert = os.path.join(d, name + ".key"), os.path.join(d, name + ".crt")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=" + name], check=True,
                   capture_output=True, timeout=60)
    return cert, key


class CheckConfigTest(PxTestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.tmp = tempfile.TemporaryDirectory()
        cls.cert, cls.key = pem_pair(cls.tmp.name, "a")
        cls.cert2, cls.key2 = pem_pair(cls.tmp.name, "b")
        cls.junk = os.path.join(cls.tmp.name, "junk.pem")
        with open(cls.junk, "w") as f:
            f.write("not a certificate\n")
        cls.keys = os.path.join(cls.tmp.name, "keys")
        with open(cls.keys, "w") as f:
            f.write("key-0123456789abcdef\n")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()
        super().tearDownClass()

    def check(self, args, want_rc, *must):
        port = free_port()
        p = run_pdproxy(["--check-config", "--port", str(port)] + args, timeout=10.0)
        self.assertEqual(p.returncode, want_rc, "args %r: rc=%s stdout=%r stderr=%r"
                         % (args, p.returncode, p.stdout, p.stderr))
        for m in must:
            self.assertIn(m, p.stderr if want_rc else p.stdout, "args %r" % (args,))
        self.assertNotIn("(null)", p.stderr)
        return p, port

    def test_refuses_what_start_up_refuses(self):
        port = free_port()
        cases = [
            (["--tls-cert", "/nonexistent.crt", "--tls-key", self.key],
             "--tls-cert '/nonexistent.crt': No such file or directory"),
            (["--tls-cert", self.cert, "--tls-key", "/nonexistent.key"],
             "--tls-key '/nonexistent.key': No such file or directory"),
            (["--tls-cert", self.junk, "--tls-key", self.key], "--tls-cert '%s'" % self.junk),
            (["--tls-cert", self.cert, "--tls-key", self.key2], "--tls-key"),
            (["--api-key-file", "/nonexistent-keys"], "--api-key-file '/nonexistent-keys'"),
            (["--admin-port", str(free_port()), "--admin-token-file", "/nonexistent-token"],
             "--admin-token-file"),
            (["--prefill", "http://%s:%d" % (HOST, port), "--decode", "http://%s:9" % HOST],
             "this proxy's own listen address"),
            (["--api-key-file", "${CREDENTIALS_DIRECTORY}/k"], "CREDENTIALS_DIRECTORY"),
            (["--host", "no-such-host.invalid"], "no-such-host.invalid"),
        ]
        for args, must in cases:
            with self.subTest(args=args):
                if "this proxy's own" in must:
                    p = run_pdproxy(["--check-config", "--port", str(port)] + args, timeout=10.0)
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertIn(must, p.stderr)
                else:
                    self.check(args, 2, must)
                # --print-config stays a dump of the settings: it does not read files.
                if args[0] in ("--tls-cert", "--api-key-file"):
                    p = run_pdproxy(["--print-config"] + args, timeout=10.0)
                    self.assertEqual(p.returncode, 0, p.stderr)

    def test_a_port_in_use_is_refused(self):
        with socket.socket() as s:
            s.bind((HOST, 0))
            s.listen(1)
            p = run_pdproxy(["--check-config", "--port", str(s.getsockname()[1])], timeout=10.0)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("address already in use", p.stderr)

    def test_a_good_configuration_passes_and_binds_nothing(self):
        metrics, admin = free_port(), free_port()
        tok = os.path.join(self.tmp.name, "token")
        with open(tok, "w") as f:
            f.write("admin-token-0123456789abcdef\n")
        os.chmod(tok, 0o600)
        p, port = self.check(["--tls-cert", self.cert, "--tls-key", self.key, "--api-key-file",
                              self.keys, "--metrics-port", str(metrics), "--admin-port",
                              str(admin), "--admin-token-file", tok], 0, "configuration OK")
        # Nothing listened: each port can be bound and listened on right away
        # (SO_REUSEADDR off, so a socket left in any state would refuse).
        for q in (port, metrics, admin):
            with socket.socket() as s:
                s.bind((HOST, q))
                s.listen(1)

    def test_credentials_directory(self):
        """${CREDENTIALS_DIRECTORY} in a secret file's path: the directory
        systemd's LoadCredential= gives the service."""
        env = dict(os.environ, CREDENTIALS_DIRECTORY=self.tmp.name)
        for args in (["--api-key-file", "${CREDENTIALS_DIRECTORY}/keys"],
                     ["--tls-cert", "$CREDENTIALS_DIRECTORY/a.crt", "--tls-key",
                      "${CREDENTIALS_DIRECTORY}/a.key"]):
            with self.subTest(args=args):
                p = run_pdproxy(["--check-config", "--port", str(free_port())] + args, env=env,
                                timeout=10.0)
                self.assertEqual(p.returncode, 0, p.stderr)


if __name__ == "__main__":
    main()
