#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""pdproxy command line: toy-proxy flags, lists, env vars, --help/--version,
bad values (exit 2), startup time, /healthcheck."""

import json
import re

from pdharness.case import PxTestCase, main
from pdharness.client import http_request
from pdharness.mocks import completion_body, decode_handler, prefill_handler
from pdharness.net import HOST, free_port
from pdharness.procs import WARN_RE, run_pdproxy, start_pdproxy

TOY_FLAGS = ["--host", "--port", "--prefiller-hosts", "--prefiller-host", "--prefiller-ports",
             "--prefiller-port", "--decoder-hosts", "--decoder-host", "--decoder-ports",
             "--decoder-port"]
OTHER_FLAGS = ["--threads", "--max-body-bytes", "--connect-timeout", "--log-level", "--help",
               "--version"]


class CliTest(PxTestCase):

    def test_help_lists_flags(self):
        p = run_pdproxy(["--help"])
        self.assertEqual(p.returncode, 0, p.stderr)
        for f in TOY_FLAGS + OTHER_FLAGS:
            self.assertRegex(p.stdout, r"(?<![\w-])%s(?![\w-])" % f, "--help lacks %s" % f)

    def test_version(self):
        p = run_pdproxy(["--version"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertRegex(p.stdout.strip().splitlines()[0], r"^pdproxy \d+\.\d+\.\d+\S*$")

    def _expect_usage_error(self, args, must_name=None):
        p = run_pdproxy(["--port", str(free_port())] + args, timeout=5.0)
        self.assertEqual(p.returncode, 2, "args %r: rc=%s stderr=%r" % (args, p.returncode, p.stderr))
        self.assertTrue(p.stderr.strip(), "args %r: no message on stderr" % (args,))
        if must_name:
            self.assertIn(must_name, p.stderr, "args %r: stderr does not name %r" % (args, must_name))
        return p

    def test_mismatched_prefill_counts_exit_2(self):
        self._expect_usage_error(["--prefiller-hosts", HOST, HOST, "--prefiller-ports", "8100"])

    def test_mismatched_decode_counts_exit_2(self):
        self._expect_usage_error(["--decoder-hosts", HOST, "--decoder-ports", "8200", "8201"])

    def test_single_host_many_ports_not_assumed(self):
        # The toy proxy would zip() these; pdproxy refuses instead.
        self._expect_usage_error(["--prefiller-hosts", HOST, "--prefiller-ports", "8100", "8101",
                                  "8102"])

    def test_bad_values_exit_2_naming_flag(self):
        cases = [
            (["--port", "abc"], "port"),
            (["--port", "70000"], "port"),
            (["--threads", "many"], "threads"),
            (["--max-body-bytes", "lots"], "max-body-bytes"),
            (["--connect-timeout", "soon"], "connect-timeout"),
            (["--log-level", "loud"], "log-level"),
            (["--prefiller-ports", "notaport"], "prefiller-port"),
            (["--decoder-ports", "99999"], "decoder-port"),
        ]
        for args, name in cases:
            with self.subTest(args=args):
                self._expect_usage_error(args, must_name=name)

    def test_unknown_flag_exit_2(self):
        self._expect_usage_error(["--no-such-flag"], must_name="no-such-flag")

    def test_missing_value_exit_2(self):
        p = run_pdproxy(["--port"], timeout=5.0)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("port", p.stderr)

    def test_listening_within_one_second(self):
        p = self.start_proxy(threads=None, args=["--prefiller-hosts", HOST, "--prefiller-ports",
                                                 "1", "--decoder-hosts", HOST, "--decoder-ports",
                                                 "2"])
        self.assertLessEqual(p.ready_after, 1.0, "took %.3fs to listen" % p.ready_after)

    def test_healthcheck_counts(self):
        ps = [self.mock(name="p%d" % i) for i in range(2)]
        ds = [self.mock(name="d%d" % i) for i in range(3)]
        p = self.start_proxy(ps, ds)
        r = http_request(p.port, "GET", "/healthcheck")
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(r.json(), {"status": "ok", "prefill_instances": 2, "decode_instances": 3})
        doc = r.json()
        self.assertIs(type(doc["prefill_instances"]), int)
        self.assertIs(type(doc["decode_instances"]), int)

    def test_defaults_one_prefill_one_decode(self):
        # Defaults: localhost:8100 and localhost:8200, one of each.
        p = self.start_proxy(args=[])
        r = http_request(p.port, "GET", "/healthcheck")
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(r.json(), {"status": "ok", "prefill_instances": 1, "decode_instances": 1})

    def test_singular_toy_aliases(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        p = self.start_proxy(args=["--prefiller-host", HOST, "--prefiller-port", str(P.port),
                                   "--decoder-host", HOST, "--decoder-port", str(D.port)])
        r = http_request(p.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(P.requests), 1)
        self.assertEqual(len(D.requests), 1)

    def test_list_flags_take_several_values(self):
        ps = [self.mock(prefill_handler(), name="p%d" % i) for i in range(2)]
        ds = [self.mock(decode_handler(), name="d%d" % i) for i in range(2)]
        p = self.start_proxy(threads=1, args=[
            "--prefiller-hosts", HOST, "localhost", "--prefiller-ports", str(ps[0].port),
            str(ps[1].port), "--decoder-hosts", HOST, HOST, "--decoder-ports", str(ds[0].port),
            str(ds[1].port)])
        r = http_request(p.port, "GET", "/healthcheck")
        self.assertEqual(r.json()["prefill_instances"], 2)
        self.assertEqual(r.json()["decode_instances"], 2)
        for _ in range(2):
            r = http_request(p.port, "POST", "/v1/completions", completion_body())
            self.assertEqual(r.status, 200, r.body)
        self.assertEqual([len(m.requests) for m in ps + ds], [1, 1, 1, 1])

    def test_env_vars(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        proxy = start_pdproxy(
            lambda port: [], self.track_proxy,
            make_env=lambda port: {
                "PDPROXY_HOST": HOST, "PDPROXY_PORT": str(port),
                "PDPROXY_PREFILLER_HOSTS": HOST, "PDPROXY_PREFILLER_PORTS": str(P.port),
                "PDPROXY_DECODER_HOSTS": HOST, "PDPROXY_DECODER_PORTS": str(D.port),
                "PDPROXY_MAX_BODY_BYTES": "200", "PDPROXY_THREADS": "1"})
        port = proxy.port
        self.assertTrue(proxy.owns_port(), "no port of our own")
        r = http_request(port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual((len(P.requests), len(D.requests)), (1, 1))
        r = http_request(port, "POST", "/v1/completions", completion_body(prompt="x" * 300))
        self.assertErrorJson(r, 413)
        self.assertEqual(len(P.requests), 1)

    def _kv_warning_run(self, level):
        doc = {"choices": [{"text": "x"}]}  # no kv_transfer_params: a warning
        P = self.mock(prefill_handler(raw_body=json.dumps(doc).encode()), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_proxy([P], [D], extra=["--log-level", level])
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(D.requests), 1)
        return px

    def test_log_level_warn_keeps_warnings_drops_info(self):
        px = self._kv_warning_run("warn")
        self.assertWarned(px, "kv_transfer_params")
        # Access lines (msg="request") have their own switch, --access-log.
        info = [l for l in px.stderr().splitlines() if re.search(r"(?i)\binfo\b", l)
                and 'msg="request"' not in l]
        self.assertEqual(info, [], "info lines at --log-level warn")

    def test_log_level_error_drops_warnings(self):
        px = self._kv_warning_run("error")
        # The request's access line comes after its warning would have.
        self.wait_access(px)
        lines = [l for l in px.stderr().splitlines() if (WARN_RE.search(l)
                 or re.search(r"(?i)\binfo\b", l)) and 'msg="request"' not in l]
        self.assertEqual(lines, [], "warn/info lines at --log-level error")

    def test_env_bad_value_exit_2(self):
        p = run_pdproxy(["--port", str(free_port())], env={"PDPROXY_THREADS": "lots"})
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("THREADS", p.stderr.upper())


if __name__ == "__main__":
    main()
