#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Issue 5 item 9, configuration: every flag also as PDPROXY_<NAME> (flags
win), --print-config dumps the effective values with secrets masked, and an
invalid value (flag or environment) exits 2 naming the flag, the value and
the reason."""

import re
import unittest

from pdharness.client import http_request
from pdharness.mocks import Respond, decode_handler, prefill_handler
from pdharness.net import free_port
from pdharness.procs import run_pdproxy
from pdharness.prod import ProdCase

# A valid, non-default value for each option, as the environment gives it,
# and how --print-config must show it (None: the same text).
SAMPLES = {
    "host": ("0.0.0.0", None),
    "port": ("8123", None),
    "prefiller-hosts": ("p1.example, p2.example", "p1.example p2.example"),
    "prefiller-ports": ("8101 8102", None),
    "decoder-hosts": ("d1.example", None),
    "decoder-ports": ("8201", None),
    "prefill": ("http://p.example:81 https://q.example:8443", None),
    "decode": ("http://d.example:82", None),
    "dns-refresh": ("2.5", None),
    "k8s-api": ("https://10.96.0.1:443", None),
    "k8s-token-file": ("/run/k8s/token", None),
    "k8s-ca-file": ("/run/k8s/ca.crt", None),
    "kubeconfig": ("/home/u/.kube/config", None),
    "threads": ("3", None),
    "max-body-bytes": ("1000", None),
    "max-inflight": ("7", None),
    "connect-timeout": ("1.5", None),
    "prefill-timeout": ("30", None),
    "decode-idle-timeout": ("45", None),
    "client-header-timeout": ("4", None),
    "keepalive-timeout": ("9", None),
    "upstream-keepalive": ("17", None),
    "send-timeout": ("11", None),
    "max-buffered-bytes": ("1048576", None),
    "max-connections": ("64", None),
    "reuse-port": ("true", None),
    "metrics-host": ("127.0.0.9", None),
    "metrics-port": ("9464", None),
    "metrics-auth": ("true", None),
    "health-interval": ("0.5", None),
    "health-timeout": ("0.25", None),
    "unhealthy-after": ("5", None),
    "healthy-after": ("4", None),
    "prefill-retries": ("3", None),
    "fallback-decode-only": ("true", None),
    "prefill-policy": ("prefix_affinity", None),
    "decode-policy": ("least_inflight", None),
    "dispatch": ("concurrent", None),
    "prefix-bytes": ("128", None),
    "prefix-load-factor": ("1.5", None),
    "metrics-interval": ("0.5", None),
    "disagg-min-tokens": ("300", None),
    "prefill-dp-size": ("2", None),
    "decode-dp-size": ("4", None),
    "disagg-bytes-per-token": ("3.5", None),
    "disagg-index-blocks": ("1000", None),
    "kv-events-port": ("5557", None),
    "kv-events-replay-port": ("5558", None),
    "kv-index-max-blocks": ("2048", None),
    "kv-index-max-bytes": ("8388608", None),
    "kv-cache-weight": ("2.5", None),
    "kv-load-weight": ("0.5", None),
    "tokenize-timeout": ("0.25", None),
    "tokenize-cache-entries": ("128", None),
    "session-header": ("x-conversation", None),
    "session-ttl": ("30", None),
    "usage-from": ("decode", None),
    "drain-delay": ("0", None),
    "drain-timeout": ("12", None),
    "tls-cert": ("/nonexistent/cert.pem", None),
    "tls-key": ("/nonexistent/key.pem", None),
    "upstream-ca": ("/nonexistent/ca.pem", None),
    "tls-client-ca": ("/nonexistent/clients.pem", None),
    "tls-client-verify": ("optional", None),
    "upstream-insecure": ("yes", "true"),
    "api-key": ("env-secret-one", "(set)"),
    "api-key-file": ("/nonexistent/keys", None),
    "upstream-api-key": ("env-secret-two", "(set)"),
    "log-level": ("debug", None),
    "log-format": ("json", None),
    "access-log": ("false", None),
    "access-log-buffer": ("8192", None),
    "access-log-flush": ("0.5", None),
    "log-file": ("/nonexistent/pdproxy.log", None),
    "admin-host": ("127.0.0.2", None),
    "admin-port": ("9465", None),
    "admin-token-file": ("/nonexistent/token", None),
    "prefiller-from-header": ("true", None),
    "allow-empty-pools": ("true", None),
    "loop-limit": ("3", None),
    "queue-max": ("40", None),
    "queue-max-bytes": ("1000000", None),
    "queue-timeout": ("2.5", None),
    "pool-max-inflight": ("8", None),
    "saturate-waiting": ("5", None),
    "saturate-kv-usage": ("0.9", None),
    "saturate-ttfb": ("2.5", None),
    "engine-backoff": ("0.5", None),
    "tenant-header": ("x-team", None),
    "priority-header": ("x-prio", None),
    "priority-class": ("hi:-5..0, lo:1..9", "hi:-5..0 lo:1..9"),
    "tenant": ("a:weight=2:rpm=60, b", "a:weight=2:rpm=60 b"),
    "tenant-header-from": ("10.0.0.0/8, 192.0.2.7", "10.0.0.0/8 192.0.2.7"),
    "tenant-keys": ("/nonexistent/tenant-keys", None),
    "tenant-certs": ("/nonexistent/tenant-certs", None),
    "cache-salt": ("key", None),
    "default-max-tokens": ("512", None),
    "prefiller-allowlist": ("10.0.0.0/8:*, prefill.example:8000", "10.0.0.0/8:* prefill.example:8000"),
    "slo-ttft-ms": ("750", None),
    "slo-tpot-ms": ("40", None),
    "slo-miss": ("refuse", None),
    "slo-refuse-status": ("429", None),
    "slo": ("class=hi:ttft=500, pool=*:tpot=50:miss=queue", "class=hi:ttft=500 pool=*:tpot=50:miss=queue"),
    "latency-decode-only": ("false", None),
    "latency-half-life": ("12", None),
    "latency-keep": ("0.9", None),
}
# Options that --print-config shows in another form: the file itself, and
# the pools (a "pools:" list).
NOT_DUMPED = {"config", "pool"}
SECRETS = ("env-secret-one", "env-secret-two")


def env_name(opt):
    return "PDPROXY_" + opt.upper().replace("-", "_")


def parse_dump(text):
    """--print-config's YAML, one "key: value" line per setting (flow lists
    and quoted strings read as the text form); secrets are comments
    "# key: (set)"."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(?:# )?([a-z][a-z0-9-]*): ?(.*)$", line)
        if not m:
            continue
        k, v = m.group(1), m.group(2).strip()
        if v.startswith("["):
            v = " ".join(x.strip().strip('"') for x in v.strip("[]").split(",") if x.strip())
        elif v.startswith('"'):
            v = v[1:-1]
        elif v == "(not set)":
            v = ""
        out[k] = v
    return out


def help_flags():
    p = run_pdproxy(["--help"])
    # Flags open their line with two spaces; wrapped descriptions are indented
    # further and may start with a flag they mention.
    return sorted(set(re.findall(r"^  --([a-z][a-z0-9-]*)", p.stdout, re.M)) -
                  {"help", "help-markdown", "version", "print-config", "check-config"})


class PrintConfigTest(ProdCase):
    def test_print_config_lists_every_flag(self):
        p = run_pdproxy(["--print-config"])
        self.assertEqual(p.returncode, 0, p.stderr)
        dump = parse_dump(p.stdout)
        missing = [f for f in help_flags() if f not in dump and f not in NOT_DUMPED]
        self.assertEqual(missing, [], "--print-config omits options listed by --help")
        self.assertEqual(dump["prefill-policy"], "round_robin")
        self.assertEqual(dump["health-interval"], "5")
        self.assertEqual(dump["drain-delay"], "5")

    def test_every_option_from_environment(self):
        env = {env_name(k): v for k, (v, _) in SAMPLES.items()}
        p = run_pdproxy(["--print-config"], env=env)
        self.assertEqual(p.returncode, 0, p.stderr)
        dump = parse_dump(p.stdout)
        for opt, (val, shown) in SAMPLES.items():
            if opt not in dump:
                continue  # not an option of this build (reported by the test above)
            with self.subTest(option=opt, env=env_name(opt)):
                want = shown if shown is not None else val
                got = dump[opt]
                try:
                    self.assertEqual(float(got), float(want))
                except ValueError:
                    self.assertEqual(got.split(), want.split())
        untested = [f for f in help_flags() if f not in SAMPLES and f not in NOT_DUMPED]
        self.assertEqual(untested, [], "options without an environment sample in this test")

    def test_secrets_masked(self):
        p = run_pdproxy(["--print-config", "--api-key", "flag-secret-xyz", "--upstream-api-key",
                         "flag-secret-abc"], env={"OPENAI_API_KEY": "x"})
        self.assertEqual(p.returncode, 0, p.stderr)
        for s in ("flag-secret-xyz", "flag-secret-abc"):
            self.assertNotIn(s, p.stdout + p.stderr, "--print-config leaks a secret")
        dump = parse_dump(p.stdout)
        self.assertEqual(dump["api-key"], "(set)")
        self.assertEqual(dump["upstream-api-key"], "(set)")
        env = {env_name(k): v for k, (v, _) in SAMPLES.items()}
        p = run_pdproxy(["--print-config"], env=env)
        for s in SECRETS:
            self.assertNotIn(s, p.stdout + p.stderr)

    def test_flags_win_over_environment(self):
        env = {"PDPROXY_MAX_INFLIGHT": "7", "PDPROXY_PREFILL_POLICY": "load_aware",
               "PDPROXY_PREFILL": "http://env.example:1",
               "PDPROXY_FALLBACK_DECODE_ONLY": "true"}
        p = run_pdproxy(["--print-config", "--max-inflight", "9", "--prefill-policy",
                         "power_of_two", "--prefill", "http://flag.example:2",
                         "--prefill", "http://flag.example:3", "--fallback-decode-only=false"],
                        env=env)
        self.assertEqual(p.returncode, 0, p.stderr)
        dump = parse_dump(p.stdout)
        self.assertEqual(dump["max-inflight"], "9")
        self.assertEqual(dump["prefill-policy"], "power_of_two")
        self.assertEqual(dump["prefill"].split(), ["http://flag.example:2",
                                                   "http://flag.example:3"],
                         "--prefill on the command line replaces PDPROXY_PREFILL")
        self.assertEqual(dump["fallback-decode-only"], "false")

    def test_print_config_does_not_listen(self):
        port = free_port()
        p = run_pdproxy(["--print-config", "--port", str(port)])
        self.assertEqual(p.returncode, 0)
        self.assertEqual(parse_dump(p.stdout)["port"], str(port))


class EnvironmentRuntimeTest(ProdCase):
    """The environment drives a real run: URL list, flag, enum, seconds,
    integer and secret options all taken from PDPROXY_*."""

    def test_env_only_configuration_is_used(self):
        P = [self.mock(prefill_handler(), name="P%d" % i) for i in range(2)]
        D = self.mock(decode_handler(), name="D")
        env = {
            "PDPROXY_PREFILL": "http://127.0.0.1:%d,http://127.0.0.1:%d" % (P[0].port, P[1].port),
            "PDPROXY_DECODE": "http://127.0.0.1:%d" % D.port,
            "PDPROXY_PREFILL_POLICY": "round_robin",
            "PDPROXY_FALLBACK_DECODE_ONLY": "true",
            "PDPROXY_HEALTH_INTERVAL": "0.1",
            "PDPROXY_UNHEALTHY_AFTER": "1",
            "PDPROXY_API_KEY": "env-key-123",
            "PDPROXY_DRAIN_DELAY": "0",
        }
        px = self.start_proxy(args=[], env=env)
        r = http_request(px.port, "GET", "/healthcheck")
        self.assertEqual(r.json()["prefill_instances"], 2)
        self.assertEqual(r.json()["decode_instances"], 1)
        r = self.post(px)
        self.assertErrorJson(r, 401, "PDPROXY_API_KEY set, no key sent")
        auth = {"Authorization": "Bearer env-key-123"}
        for i in range(4):
            self.assertEqual(self.post(px, headers=auth).status, 200)
        self.assertEqual([len(m.requests) for m in P], [2, 2])
        # PDPROXY_FALLBACK_DECODE_ONLY with every prefill ejected by the
        # PDPROXY_HEALTH_INTERVAL / PDPROXY_UNHEALTHY_AFTER checks.
        for m in P:
            m.probe_handler = lambda req: Respond(503, [], b"")
        for m in P:
            self.wait_up(px, "prefill", m, 0, 3.0)
        r = self.post(px, headers=auth)
        self.assertEqual(r.status, 200, r)
        self.assertNotIn("kv_transfer_params", D.requests[-1].json())
        self.assertEqual([len(m.requests) for m in P], [2, 2])

    def test_toy_lists_from_env(self):
        P = [self.mock(prefill_handler(), name="P%d" % i) for i in range(2)]
        D = self.mock(decode_handler(), name="D")
        env = {"PDPROXY_PREFILLER_HOSTS": "127.0.0.1 127.0.0.1",
               "PDPROXY_PREFILLER_PORTS": "%d,%d" % (P[0].port, P[1].port),
               "PDPROXY_DECODER_HOSTS": "127.0.0.1",
               "PDPROXY_DECODER_PORTS": str(D.port),
               "PDPROXY_HEALTH_INTERVAL": "0", "PDPROXY_DRAIN_DELAY": "0"}
        px = self.start_proxy(args=[], env=env)
        for i in range(4):
            self.assertEqual(self.post(px).status, 200)
        self.assertEqual([len(m.requests) for m in P], [2, 2])

    def test_port_flag_wins_over_env(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        other = free_port()
        px = self.start([P], [D], env={"PDPROXY_PORT": str(other)})
        self.assertEqual(http_request(px.port, "GET", "/health").status, 200)


class InvalidValuesTest(ProdCase):
    CASES = [
        (["--port", "70000"], {}, "--port", "70000"),
        (["--max-inflight", "-1"], {}, "--max-inflight", "-1"),
        (["--prefill-policy", "fastest"], {}, "--prefill-policy", "fastest"),
        (["--decode-policy", "Round_Robin"], {}, "--decode-policy", "Round_Robin"),
        (["--prefill", "ftp://p.example:1"], {}, "--prefill", "ftp://p.example:1"),
        (["--decode", "http://d.example:99999"], {}, "--decode", "http://d.example:99999"),
        (["--decode", "http://d.example:80/v1"], {}, "--decode", "http://d.example:80/v1"),
        (["--dns-refresh", "soon"], {}, "--dns-refresh", "soon"),
        (["--dns-refresh", "0"], {}, "--dns-refresh", "0"),
        (["--health-interval", "-1"], {}, "--health-interval", "-1"),
        (["--unhealthy-after", "0"], {}, "--unhealthy-after", "0"),
        (["--prefill-retries", "many"], {}, "--prefill-retries", "many"),
        (["--prefix-load-factor", "0.5"], {}, "--prefix-load-factor", "0.5"),
        (["--fallback-decode-only=maybe"], {}, "--fallback-decode-only", "maybe"),
        (["--log-format", "xml"], {}, "--log-format", "xml"),
        (["--prefiller-ports", "80", "0"], {}, "--prefiller-ports", "0"),
        # A URL given to a toy host flag (issue 16): an error with a hint.
        (["--prefiller-hosts", "http://127.0.0.1"], {}, "--prefiller-hosts", "http://127.0.0.1"),
        (["--decoder-host", "d.example/v1"], {}, "--decoder-hosts", "d.example/v1"),
        ([], {"PDPROXY_PREFILLER_HOSTS": "https://p.example"}, "--prefiller-hosts",
         "https://p.example"),
        ([], {"PDPROXY_PREFILL_POLICY": "fastest"}, "--prefill-policy", "fastest"),
        ([], {"PDPROXY_MAX_INFLIGHT": "lots"}, "--max-inflight", "lots"),
        ([], {"PDPROXY_FALLBACK_DECODE_ONLY": "2"}, "--fallback-decode-only", "2"),
        ([], {"PDPROXY_DECODE": "http://ok.example:1 gopher://x:2"}, "--decode", "gopher://x:2"),
        ([], {"PDPROXY_DRAIN_TIMEOUT": "-3"}, "--drain-timeout", "-3"),
    ]

    def test_url_in_toy_host_flag_names_the_url_flag(self):
        p = run_pdproxy(["--prefiller-hosts", "http://127.0.0.1", "--print-config"])
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("use --prefill http://127.0.0.1", p.stderr)

    def test_invalid_values_exit_2(self):
        for args, env, flag, value in self.CASES:
            with self.subTest(args=args, env=env):
                p = run_pdproxy(args + ["--print-config"], env=env)
                self.assertEqual(p.returncode, 2, "exit status; stderr=%r" % p.stderr)
                err = p.stderr
                self.assertIn(flag, err, "the message names the flag")
                self.assertIn(value, err, "the message names the value")
                # A reason beyond "flag 'value'".
                rest = err.replace(flag, "").replace(value, "").replace("pdproxy", "")
                self.assertRegex(rest, r"[a-z]{4,}", "the message gives a reason: %r" % err)
                self.assertEqual(p.stdout, "", "nothing printed as if the config were valid")
                for name in env:
                    self.assertIn(name, err, "a bad environment value names its variable")


if __name__ == "__main__":
    unittest.main(verbosity=2)
