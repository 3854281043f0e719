# SPDX-License-Identifier: Apache-2.0
"""PdCase: what is shared by the per-request decision tests (conditional
disaggregation, decode-only fallback, the endpoints passed to decode, usage
across the two legs): access-log records, metrics, engine-sim.

Every wait is bounded by a deadline."""

import os

from pdharness.case import PxTestCase
from pdharness.logs import parse_logfmt
from pdharness.net import wait_until
from pdharness.procs import start_engine_sim
from pdharness.prom import metric, prom, prom_values


class PdCase(PxTestCase):
    """PxTestCase with access-log, metrics and engine-sim conveniences."""

    def access(self, px):
        """Access-log records (logfmt lines with total_ms), in order."""
        out = []
        for line in px.stderr().splitlines():
            if "total_ms=" in line and 'msg="request"' in line:
                out.append(parse_logfmt(line))
        return out

    def access_for(self, px, rid, timeout=5.0):
        """The one access record of request id `rid` (waits for it)."""
        wait_until(lambda: any(r.get("req") == rid for r in self.access(px)), timeout, 0.02)
        mine = [r for r in self.access(px) if r.get("req") == rid]
        self.assertEqual(len(mine), 1, "access lines for %s: %r" % (rid, mine))
        return mine[0]

    def metric(self, px, name, **labels):
        return metric(prom(px.port), name, **labels)

    def engine(self, role, extra=()):
        """An engine-sim on a free port, stopped (and required to exit
        cleanly) at the end of the test."""
        p = start_engine_sim(role, extra)
        self.addCleanup(self._stop_engine, p)
        return p

    def _stop_engine(self, p):
        rc = p.stop()
        log = p.log()
        try:
            os.unlink(p.log_path)
        except OSError:
            pass
        if rc != 0:
            raise AssertionError("%s exited with status %s:\n%s" % (p.name, rc, log[-4000:]))

    @staticmethod
    def engine_metric(port, name):
        return prom_values(port).get(name)


def rid_headers(rid, extra=None):
    h = {"X-Request-Id": rid}
    h.update(extra or {})
    return h


# Prose for prompts: words of several lengths and some punctuation, so that
# byte counts and engine-sim's token counts relate as they do for text.
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "examine ancient manuscripts about distributed inference, caching, and "
         "scheduling; engineers measure latency carefully before they decide.").split()


def prose(nbytes, seed=0):
    """About nbytes of deterministic English-like text."""
    out, i = [], seed
    total = 0
    while total < nbytes:
        w = WORDS[(i * 7 + seed) % len(WORDS)]
        out.append(w)
        total += len(w) + 1
        i += 1
    return " ".join(out)[:max(nbytes, 1)]
