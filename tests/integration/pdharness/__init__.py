# SPDX-License-Identifier: Apache-2.0
"""pdharness: the one harness of pdproxy's integration tests and benchmarks
(Python 3 standard library only).

Modules, by what they own:

* ``net``: free ports, bounded waits (wait_until, wait_for, wait_http),
  /proc/net views, Blackhole.
* ``procs``: pdproxy and engine-sim processes: start (one start loop with a
  readiness wait), stop, sanitizer checks (sanitized, slack, SANITIZER_RE).
* ``mocks``: mock prefill / decode engines and their canned answers.
* ``client``: RawClient, http_request, reading JSON and SSE answers.
* ``prom``: the Prometheus text parser and metric lookup.
* ``logs``: the logfmt parser.
* ``namespace``: pdproxy in a mount namespace with the test's /etc/hosts and
  resolv.conf, and a name server that never answers.
* ``case``: PxTestCase; ``prod``: ProdCase; ``pd``: PdCase; ``ctl``: the
  control-plane helpers; ``cluster``: ClusterCase (engine-sim end to end);
  ``connector``: the connector's test peers and wire helpers.

Test scripts in tests/integration find the package beside them (a script's
own folder is first on sys.path); the benchmarks and tests/plugin's harness
put tests/integration on sys.path themselves.

Every loop is bounded by a deadline and an iteration count."""
