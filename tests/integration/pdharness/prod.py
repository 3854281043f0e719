# SPDX-License-Identifier: Apache-2.0
"""ProdCase: PxTestCase for the production-feature tests (issue 5).

pdproxy starts with ``--drain-delay 0`` and ``--health-interval 0`` unless
the test passes its own values; helpers read pdproxy's /metrics with labels,
poll a backend's health gauge, and send many requests concurrently.

Every loop is bounded by a deadline and a count."""

import os

from pdharness.case import PxTestCase
from pdharness.client import http_request, run_concurrently
from pdharness.ctl import admin, pools_yaml, tmpdir, token_file, write_yaml
from pdharness.mocks import completion_body
from pdharness.net import HOST, free_port, now, wait_value
from pdharness.procs import ProxyStartError
from pdharness.prom import metric, prom


class ProdCase(PxTestCase):
    """PxTestCase with defaults fit for these tests."""

    def start(self, prefill=(), decode=(), extra=(), env=None, threads=2, args=None,
              health_interval="0", drain_delay="0"):
        extra = list(extra)
        if "--health-interval" not in extra and health_interval is not None:
            extra += ["--health-interval", str(health_interval)]
        if "--drain-delay" not in extra and drain_delay is not None:
            extra += ["--drain-delay", str(drain_delay)]
        if args is not None:
            args = list(args) + extra
        return self.start_proxy(prefill, decode, extra, env=env, threads=threads, args=args)

    @staticmethod
    def bname(m):
        """A mock's backend name in pdproxy's logs and metrics."""
        return "%s:%d" % (getattr(m, "bind_host", HOST), m.port)

    def up(self, px, role, mock):
        return metric(prom(px.port), "pdproxy_backend_up", role=role, backend=self.bname(mock))

    def wait_up(self, px, role, mock, want, timeout):
        """Poll pdproxy_backend_up until it equals `want`; returns the time it did."""
        last = wait_value(lambda: self.up(px, role, mock), lambda v: v == want, timeout)
        if last == want:
            return now()
        self.fail("pdproxy_backend_up{role=%s,backend=%s} stayed %r, wanted %r after %.1fs"
                  % (role, self.bname(mock), last, want, timeout))

    def post(self, px, body=None, path="/v1/completions", headers=None, timeout=10.0):
        return http_request(px.port, "POST", path, body or completion_body(),
                            headers=headers, timeout=timeout)

    def concurrent(self, fn, n, workers=None, timeout=30.0):
        """Runs fn(i) for i in range(n) on `workers` threads (default n);
        returns the results in order (an exception is returned as it is)."""
        results, done = run_concurrently(fn, n, workers, timeout)
        self.assertTrue(done, "client threads still running after %.0fs" % timeout)
        return results


class AdminCase(ProdCase):
    """A proxy started from a config file in a fresh folder, with its admin
    API on a port of its own and a token file."""

    def setUp(self):
        super().setUp()
        self.dir = tmpdir(self)
        self.tokpath, self.token = token_file(self, self.dir)
        self.file = os.path.join(self.dir, "pdproxy.yaml")

    def start_admin(self, config, extra=()):
        """config: the file's YAML text, or pools as pools_yaml takes them."""
        write_yaml(self.file, config if isinstance(config, str) else pools_yaml(config))
        for _ in range(3):
            self.aport = free_port()
            try:
                return self.start(args=["--config", self.file, "--admin-port", str(self.aport),
                                        "--admin-token-file", self.tokpath] + list(extra))
            except ProxyStartError as e:
                if "admin" not in str(e):
                    raise
        raise AssertionError("no free admin port")

    def call(self, method, path, body=None, token=True):
        """token: True for the case's own, else the one to send (None: none)."""
        return admin(self.aport, method, path, body, self.token if token is True else token)
