# SPDX-License-Identifier: Apache-2.0
"""ClusterCase: the unittest base of the end-to-end tests, real engine-sim
and pdproxy processes (procs.start_engine_sim, procs.start_sim_proxy) on
127.0.0.1 with the connector moving KV blocks over UCX on loopback."""

import os
import unittest


class ClusterCase(unittest.TestCase):
    """Tracks processes; after each test stops them and requires a clean exit
    (status 0: under ASan a leak or an error report fails the test)."""

    def setUp(self):
        self.procs = []

    def start(self, p):
        self.procs.append(p)
        return p

    def tearDown(self):
        bad = []
        for p in reversed(self.procs):
            killed = p.proc.returncode is not None and p.proc.returncode < 0
            rc = p.stop()
            if not killed and rc != 0:
                bad.append("%s exited with status %s" % (p.name, rc))
        if bad or not getattr(self._outcome, "success", True):
            for p in self.procs:
                print("----- %s (last lines)\n%s" % (p.name, "\n".join(p.log().splitlines()[-25:])))
        for p in self.procs:
            try:
                os.unlink(p.log_path)
            except OSError:
                pass
        self.assertEqual(bad, [], "processes must exit cleanly")
