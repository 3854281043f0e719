# SPDX-License-Identifier: Apache-2.0
"""PxTestCase: the unittest base of pdproxy's integration tests.

start_proxy() (pdproxy on a free port through procs.start_pdproxy), mock()
(a MockBackend), blackhole(), each stopped by the test's cleanup, which also
fails the test if pdproxy died during it or a sanitizer reported anything,
and prints pdproxy's stderr when the test failed. With PX_MOCK_TLS=1,
proxy_args() names the mocks as https:// URLs with --upstream-ca, so the
same upstream tests run through pdproxy's https transport."""

import os
import re
import sys
import unittest

from pdharness.client import strict_json
from pdharness.logs import parse_logfmt
from pdharness.mocks import MOCK_TLS, MockBackend, mock_tls
from pdharness.net import HOST, Blackhole, wait_until
from pdharness.procs import PDPROXY, SANITIZER_RE, WARN_RE, start_pdproxy


def case_failed(tc):
    """Whether test case `tc` has recorded a failure or error so far (usable
    from a cleanup: unittest resets its own success flag for each part)."""
    outcome = getattr(tc, "_outcome", None)
    res = getattr(outcome, "result", None)
    if res is None:
        return True
    for test, _ in list(getattr(res, "failures", [])) + list(getattr(res, "errors", [])):
        if test is tc or getattr(test, "test_case", None) is tc:
            return True
    return False


class PxTestCase(unittest.TestCase):
    """Base class: start_proxy(), mock(), blackhole(), with cleanup, crash
    detection, and pdproxy's stderr printed when a test fails."""

    def setUp(self):
        if not os.access(PDPROXY, os.X_OK):
            self.fail("pdproxy binary not found at %s (set PX_BIN_DIR)" % PDPROXY)
        self._proxies = []
        self._mocks = []

    def mock(self, handler=None, name=None):
        m = MockBackend(handler, name=name or "mock%d" % len(self._mocks))
        self._mocks.append(m)
        self.addCleanup(self._stop_mock, m)
        return m

    def _stop_mock(self, m):
        m.stop()
        if m.errors:
            raise AssertionError("mock %s recorded errors: %s" % (m.name, m.errors))

    def blackhole(self):
        b = Blackhole()
        self.addCleanup(b.close)
        return b

    def proxy_args(self, prefill=(), decode=(), extra=()):
        """Flags for P backends `prefill` and D backends `decode`, each a list of
        MockBackend / int port / (host, port)."""

        def split(items):
            hosts, ports = [], []
            for it in items:
                if isinstance(it, MockBackend):
                    hosts.append(HOST)
                    ports.append(str(it.port))
                elif isinstance(it, tuple):
                    hosts.append(it[0])
                    ports.append(str(it[1]))
                else:
                    hosts.append(HOST)
                    ports.append(str(it))
            return hosts, ports

        args = []
        ph, pp = split(prefill)
        dh, dp = split(decode)
        if MOCK_TLS:
            for flag, hosts, ports in (("--prefill", ph, pp), ("--decode", dh, dp)):
                for h, p in zip(hosts, ports):
                    args += [flag, "https://%s:%s" % (h, p)]
            return args + ["--upstream-ca", mock_tls()[1]] + list(extra)
        if ph:
            args += ["--prefiller-hosts"] + ph + ["--prefiller-ports"] + pp
        if dh:
            args += ["--decoder-hosts"] + dh + ["--decoder-ports"] + dp
        return args + list(extra)

    def start_proxy(self, prefill=(), decode=(), extra=(), env=None, threads=2, args=None,
                    ready_timeout=5.0, prefix=()):
        """Start pdproxy listening on a free port; returns the Proxy (proxy.port).
        `args` replaces the generated backend flags entirely when given;
        `prefix` runs pdproxy behind a command (unshare ...) that execs it."""
        def make_args(port):
            a = ["--host", HOST, "--port", str(port)]
            if threads is not None:
                a += ["--threads", str(threads)]
            return a + (list(args) if args is not None
                        else self.proxy_args(prefill, decode, extra))
        return start_pdproxy(make_args, self.track_proxy, env=env,
                             ready_timeout=ready_timeout, prefix=prefix)

    def track_proxy(self, p):
        """Stop `p` (a Proxy) at cleanup, with the checks of _stop_proxy."""
        self._proxies.append(p)
        self.addCleanup(self._stop_proxy, p)
        return p

    def _stop_proxy(self, p):
        died = p.proc is not None and p.proc.poll() is not None and not p._expected_exit
        rc = p.stop()
        failed = case_failed(self) or died or os.environ.get("PX_TEST_VERBOSE")
        if failed:
            sys.stderr.write("\n----- pdproxy %s stderr (%s) -----\n%s\n----- end -----\n"
                             % (" ".join(p.args), self.id(), p.stderr()[-20000:]))
        san = SANITIZER_RE.search(p.stderr())
        if san and not failed:
            sys.stderr.write("\n----- pdproxy %s stderr (%s) -----\n%s\n----- end -----\n"
                             % (" ".join(p.args), self.id(), p.stderr()[-20000:]))
        p.remove_logs()
        if died:
            raise AssertionError("pdproxy exited during the test with status %s" % rc)
        if san:
            raise AssertionError("sanitizer report in pdproxy's stderr: %s" % san.group(0))

    # -- assertions

    def assertErrorJson(self, resp, status, msg=None):
        """resp (HttpResult or RawResponse) is an OpenAI-style error with `status`."""
        where = msg or ""
        self.assertEqual(resp.status, status, "%s status; body=%r" % (where, bytes(resp.body)[:300]))
        ct = resp.header("content-type") or ""
        self.assertTrue(ct.split(";")[0].strip().lower() == "application/json",
                        "%s Content-Type %r" % (where, ct))
        doc = strict_json(bytes(resp.body))
        self.assertIsInstance(doc, dict, where)
        self.assertIn("error", doc, where)
        err = doc["error"]
        self.assertIsInstance(err, dict, where)
        self.assertIsInstance(err.get("message"), str, "%s error.message %r" % (where, err))
        self.assertTrue(err["message"], "%s empty error.message" % where)
        self.assertIsInstance(err.get("type"), str, "%s error.type %r" % (where, err))
        # OpenAI's shape: `param` is always there, null when no parameter
        # is at fault (the proxy never names one).
        self.assertIn("param", err, "%s error without param: %r" % (where, err))
        self.assertIsNone(err["param"], "%s error.param %r" % (where, err))
        code = err.get("code")
        self.assertTrue(isinstance(code, int) and not isinstance(code, bool),
                        "%s error.code %r" % (where, code))
        self.assertEqual(code, status, where)
        return doc

    def assertChunkedComplete(self, resp, msg=None):
        self.assertFalse(resp.timed_out, msg)
        self.assertEqual(resp.framing, "chunked",
                         "%s expected Transfer-Encoding: chunked, head=%r" % (msg or "", resp.raw_head))
        self.assertTrue(resp.complete, "%s chunked body not terminated by 0-chunk" % (msg or ""))
        self.assertEqual(len(resp.header_all("transfer-encoding")), 1,
                         "%s Transfer-Encoding headers: %r" % (msg or "", resp.raw_head))

    def assertLogged(self, proxy, pattern, timeout=5.0):
        """pdproxy's stderr gets a match of regex `pattern` (waits for it:
        access lines are written in batches, --access-log-flush)."""
        found = wait_until(lambda: re.search(pattern, proxy.stderr()), timeout, 0.02)
        self.assertTrue(found, "%r not in pdproxy's stderr:\n%s"
                        % (pattern, proxy.stderr()[-4000:]))
        return found

    def wait_access(self, proxy, since=0, timeout=5.0, **fields):
        """Waits for pdproxy's access line (msg="request", logfmt) of a request
        whose fields include `fields` (outcome="client_disconnected", ...), in
        its stderr from offset `since`, and returns that record. The line is
        written when the request ends: whatever the request would still have
        done (an upstream call, a warning) is done by then, so a test that
        checks that something did not happen waits for this, not a time."""
        def find():
            for line in proxy.stderr()[since:].splitlines():
                if 'msg="request"' not in line:
                    continue
                rec = parse_logfmt(line)
                if all(str(rec.get(k)) == str(v) for k, v in fields.items()):
                    return rec
            return None
        rec = wait_until(find, timeout, 0.01)
        self.assertIsNotNone(rec, "no access line with %r in pdproxy stderr:\n%s"
                             % (fields, proxy.stderr()[since:][-4000:]))
        return rec

    def assertWarned(self, proxy, keyword, since=0, timeout=2.0):
        """pdproxy's stderr (from offset `since`) gets a warning-level line that contains keyword."""
        def find():
            text = proxy.stderr()[since:]
            return [l for l in text.splitlines() if keyword in l and WARN_RE.search(l)]
        lines = wait_until(find, timeout)
        self.assertTrue(lines, "no warning line containing %r in pdproxy stderr:\n%s"
                        % (keyword, proxy.stderr()[since:][-4000:]))
        return lines




def main():
    unittest.main(verbosity=2)
