# SPDX-License-Identifier: Apache-2.0
"""ProdCase: PxTestCase for the production-feature tests (issue 5).

pdproxy starts with ``--drain-delay 0`` and ``--health-interval 0`` unless
the test passes its own values; helpers read pdproxy's /metrics with labels,
poll a backend's health gauge, and send many requests concurrently.

Every loop is bounded by a deadline and a count."""

from pdharness.case import PxTestCase
from pdharness.client import http_request, run_concurrently
from pdharness.mocks import completion_body
from pdharness.net import HOST, now, wait_value
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
