#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The log's sink (issue 36): a log reader that stops reading never stops
the proxy (lines are dropped and counted instead); access lines are written
in batches (--access-log-buffer, --access-log-flush), and none is lost on
SIGTERM, SIGHUP or a failed request; --log-file is reopened on SIGUSR1 and
on SIGHUP (log rotation)."""

import os
import shutil
import signal
import subprocess
import tempfile
import threading

from pdharness.canned import canned_engines, drive
from pdharness.case import PxTestCase, main
from pdharness.client import http_request
from pdharness.logs import parse_logfmt
from pdharness.net import HOST, free_port, port_accepts, wait_until
from pdharness.procs import PDPROXY, Proxy, read_text
from pdharness.prom import metric, prom


def access_ids(text):
    """The request ids of the access lines in `text`, every line parsed
    strictly (a torn or merged line fails)."""
    out = []
    for line in text.splitlines():
        if 'msg="request"' in line:
            out.append(parse_logfmt(line)["req"])
    return out


def ids(rid, clients, n):
    return {"%s-%d-%d" % (rid, i, k) for i in range(clients) for k in range(n // clients)}


class LogSinkCase(PxTestCase):
    def setUp(self):
        super().setUp()
        self.P, self.D = canned_engines(self)
        self.dir = tempfile.mkdtemp(prefix="pdproxy-logsink-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def backends(self):
        return ["--prefiller-hosts", HOST, "--prefiller-ports", str(self.P.port),
                "--decoder-hosts", HOST, "--decoder-ports", str(self.D.port)]

    def proxy(self, extra=()):
        return self.start_proxy(args=self.backends() + list(extra))

    def wait_exit(self, px, timeout=10):
        px._expected_exit = True
        try:
            return px.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.fail("pdproxy did not exit")


class StalledReaderTest(LogSinkCase):
    def test_stalled_pipe_does_not_stop_the_proxy(self):
        """stderr is a pipe nobody reads (64 KiB fill it): before, the 160th
        request or so hung in a blocking write, and every later one."""
        port = free_port()
        p = subprocess.Popen([PDPROXY, "--host", HOST, "--port", str(port), "--threads", "2"]
                             + self.backends(), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=Proxy.clean_env())

        def stop():
            if p.poll() is None:
                p.kill()
            p.wait(10)
            p.stderr.close()
        self.addCleanup(stop)
        self.assertTrue(wait_until(lambda: port_accepts(port) or p.poll() is not None, 5))
        n = 3000
        served = drive(port, n, 8, timeout=10)
        self.assertEqual(served, n, "requests answered with the log's reader stalled")
        self.assertEqual(http_request(port, "GET", "/health", timeout=5).status, 200)
        dropped = metric(prom(port), "pdproxy_log_lines_dropped_total")
        self.assertIsNotNone(dropped)
        self.assertGreater(dropped, 0)
        # The reader comes back: the lines held back come, then a warning
        # that counts the dropped ones, then new access lines as before.
        got = []
        reader = threading.Thread(target=lambda: got.append(p.stderr.read()), daemon=True)
        reader.start()
        self.assertEqual(drive(port, 8, 8, rid="after"), 8)
        self.assertTrue(wait_until(lambda: metric(prom(port), "pdproxy_requests_total") > n, 5))
        os.kill(p.pid, signal.SIGINT)
        p.wait(10)
        reader.join(10)
        text = got[0].decode("utf-8", "replace") if got else ""
        warn = [l for l in text.splitlines() if "log lines dropped" in l]
        self.assertTrue(warn, "no warning about the dropped lines:\n" + text[-2000:])
        rec = parse_logfmt(warn[0])
        self.assertEqual(rec["level"], "warn")
        self.assertGreater(int(rec["dropped"]), 0)
        self.assertLessEqual(int(rec["dropped_total"]), dropped)
        self.assertTrue(ids("after", 8, 8) <= set(access_ids(text)),
                        "access lines after the reader came back are missing")
        self.assertLess(len(access_ids(text)), n, "nothing was dropped?")


class BatchTest(LogSinkCase):
    def test_every_line_whole_and_once(self):
        px = self.proxy()
        self.assertEqual(drive(px.port, 600, 6, rid="b"), 600)
        want = ids("b", 6, 600)
        self.assertTrue(wait_until(lambda: want <= set(access_ids(px.stderr())), 5),
                        "access lines missing")
        got = access_ids(px.stderr())
        self.assertEqual(len(got), len(set(got)), "an access line written twice")

    def test_lines_wait_for_the_timer_or_a_signal(self):
        """With a flush timer of a minute, access lines wait in the buffer
        until SIGHUP (a reload) writes them."""
        px = self.proxy(["--access-log-flush", "60"])
        self.assertEqual(drive(px.port, 20, 2, rid="h"), 20)
        self.assertEqual(access_ids(px.stderr()), [], "the lines were not held back")
        px.proc.send_signal(signal.SIGHUP)
        self.assertTrue(wait_until(lambda: ids("h", 2, 20) <= set(access_ids(px.stderr())), 5),
                        "SIGHUP did not write the batched lines")

    def test_timer_writes_a_quiet_batch(self):
        px = self.proxy(["--access-log-flush", "0.1"])
        self.assertEqual(drive(px.port, 3, 1, rid="t"), 3)
        self.assertTrue(wait_until(lambda: ids("t", 1, 3) <= set(access_ids(px.stderr())), 5))

    def test_unbuffered(self):
        """--access-log-buffer 0: each line at once, before the answer."""
        px = self.proxy(["--access-log-buffer", "0", "--access-log-flush", "60"])
        for k in range(3):
            self.assertEqual(drive(px.port, 1, 1, rid="u%d" % k), 1)
            self.assertIn("u%d-0-0" % k, access_ids(px.stderr()))


class ExitTest(LogSinkCase):
    def check_exit(self, sig):
        px = self.proxy(["--access-log-flush", "60", "--drain-delay", "0"])
        self.assertEqual(drive(px.port, 40, 4, rid="x"), 40)
        # Failed requests have their lines too: a bad body, a wrong method.
        r = http_request(px.port, "POST", "/v1/completions", b"{not json",
                         {"X-Request-Id": "bad-1"})
        self.assertEqual(r.status, 400)
        r = http_request(px.port, "GET", "/v1/completions", None, {"X-Request-Id": "bad-2"})
        self.assertEqual(r.status, 405)
        px.proc.send_signal(sig)
        self.assertEqual(self.wait_exit(px), 0)
        got = access_ids(px.stderr())
        self.assertTrue(ids("x", 4, 40) | {"bad-1", "bad-2"} <= set(got),
                        "access lines lost at exit")

    def test_sigterm(self):
        self.check_exit(signal.SIGTERM)

    def test_sigint(self):
        self.check_exit(signal.SIGINT)


class RotationTest(LogSinkCase):
    def rotate(self, sig, extra=()):
        path = os.path.join(self.dir, "pdproxy.log")
        px = self.proxy(["--log-file", path, "--access-log-flush", "60"] + list(extra))
        self.assertEqual(drive(px.port, 30, 3, rid="old"), 30)
        os.rename(path, path + ".1")
        px.proc.send_signal(sig)
        self.assertTrue(wait_until(lambda: os.path.exists(path), 5), "no new log file")
        self.assertEqual(drive(px.port, 30, 3, rid="new"), 30)
        px.proc.send_signal(signal.SIGINT)
        self.assertEqual(self.wait_exit(px), 0)
        old, new = read_text(path + ".1"), read_text(path)
        self.assertEqual(set(access_ids(old)), ids("old", 3, 30))
        self.assertEqual(set(access_ids(new)), ids("new", 3, 30))
        self.assertEqual(px.stderr(), "", "lines went to stderr with --log-file")
        return old, new

    def test_sigusr1(self):
        old, new = self.rotate(signal.SIGUSR1)
        self.assertIn("SIGUSR1: log reopened", new)
        self.assertIn('msg="listening"', old)

    def test_sighup(self):
        conf = os.path.join(self.dir, "pdproxy.yaml")
        with open(conf, "w") as f:
            f.write("log-level: info\n")
        old, new = self.rotate(signal.SIGHUP, ["--config", conf])
        self.assertIn("configuration swapped", new)

    def test_unwritable_file_refused(self):
        p = subprocess.run([PDPROXY, "--port", str(free_port()), "--log-file",
                            os.path.join(self.dir, "no", "such", "dir.log")] + self.backends(),
                           capture_output=True, text=True, timeout=10, env=Proxy.clean_env())
        self.assertEqual(p.returncode, 2)
        self.assertIn("--log-file", p.stderr)


if __name__ == "__main__":
    main()
