#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The access log (issue 6 item 2): one line per request on stderr, in logfmt
(the default) or JSON, with request id, endpoint, P and D backends, status,
prefill / first byte / total milliseconds, bytes out and outcome; --log-level;
no Authorization value or API key ever in stderr or in --print-config."""

import os
import tempfile
import threading
import unittest

from pdharness.case import PxTestCase, main
from pdharness.client import RawClient, http_request, raw_exchange, strict_json
from pdharness.logs import LogfmtError, parse_logfmt
from pdharness.mocks import (Hang, Respond, Stream, chat_body, completion_body, decode_handler,
                             prefill_handler, sse_events)
from pdharness.net import closed_port, wait_until
from pdharness.procs import run_pdproxy

# In every access line.  prefill, decode, prefill_ms, ttfb_ms and trace_id
# are there when known and absent when not (a request refused before any
# backend has no prefill and no first byte).
ACCESS_FIELDS = ("req", "endpoint", "status", "total_ms", "bytes_out", "outcome")
OK_FIELDS = ACCESS_FIELDS + ("prefill", "decode", "prefill_ms", "ttfb_ms", "trace_id")


def num(v):
    return float(v) if not isinstance(v, bool) else None


class LogfmtParserSelfTest(unittest.TestCase):
    """The parser rejects what logfmt readers reject (so the tests below can fail)."""

    def test_parser(self):
        self.assertEqual(parse_logfmt('a=1 b="x \\"y\\"" c'), {"a": "1", "b": 'x "y"', "c": True})
        for bad in ('a=b=c', 'a=x"y', 'a="open', 'a=1 a=2', '"k"=1', 'a="x"b', 'a="\\q"'):
            with self.assertRaises(LogfmtError, msg=bad):
                parse_logfmt(bad)


class LogTestBase(PxTestCase):

    def stop(self, px):
        """Stop pdproxy now (SIGINT) to read all it wrote; it must exit 0."""
        px._expected_exit = True
        rc = px.stop()
        self.assertEqual(rc, 0, "pdproxy exit status after SIGINT")

    def lines(self, px):
        return [l for l in px.stderr().splitlines() if l.strip()]

    def records(self, px, fmt="logfmt"):
        out = []
        for l in self.lines(px):
            if fmt == "json":
                try:
                    d = strict_json(l)
                except ValueError as e:
                    self.fail("stderr line is not valid JSON (%s): %r" % (e, l))
                self.assertIsInstance(d, dict, l)
                out.append(d)
            else:
                try:
                    out.append(parse_logfmt(l))
                except LogfmtError as e:
                    self.fail(str(e))
        return out

    def access(self, px, fmt="logfmt"):
        """Access-log records (those with total_ms), in order."""
        return [r for r in self.records(px, fmt) if "total_ms" in r]

    def wait_access(self, px, req_ids, fmt="logfmt", timeout=5.0):
        want = set(req_ids)

        def f():
            got = {str(r.get("req")) for r in self.access(px, fmt)}
            return want <= got
        wait_until(f, timeout, 0.02)
        return self.access(px, fmt)

    def one_line(self, recs, rid):
        mine = [r for r in recs if str(r.get("req")) == rid]
        self.assertEqual(len(mine), 1, "access lines for %s: %r" % (rid, mine))
        return mine[0]

    def check_fields(self, rec, where="", fields=ACCESS_FIELDS):
        for f in fields:
            self.assertIn(f, rec, "%s field %r missing in %r" % (where, f, rec))


class AccessLogTest(LogTestBase):

    def test_logfmt_fields_and_timings(self):
        P = self.mock(prefill_handler(delay=0.2), "P")
        body = b'{"id":"cmpl-d","choices":[{"index":0,"text":"hello there"}]}'
        D = self.mock(lambda r: Respond(200, [("Content-Type", "application/json")], body,
                                        delay=0.1), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers={"X-Request-Id": "obs-log-1"})
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.body, body)
        rec = self.one_line(self.wait_access(px, ["obs-log-1"]), "obs-log-1")
        self.check_fields(rec, fields=OK_FIELDS)
        self.assertEqual(rec["endpoint"], "/v1/completions")
        self.assertEqual(rec["prefill"], "127.0.0.1:%d" % P.port)
        self.assertEqual(rec["decode"], "127.0.0.1:%d" % D.port)
        self.assertEqual(num(rec["status"]), 200)
        self.assertEqual(rec["outcome"], "ok")
        self.assertEqual(num(rec["bytes_out"]), len(body))
        pms, tms, total = num(rec["prefill_ms"]), num(rec["ttfb_ms"]), num(rec["total_ms"])
        self.assertGreaterEqual(pms, 190, rec)  # P took 0.2 s
        self.assertGreaterEqual(tms, pms + 90, rec)  # then D 0.1 s before its first byte
        self.assertGreaterEqual(total, tms, rec)
        self.assertLess(total, 5000, rec)
        self.assertEqual(rec.get("level"), "info", rec)

    def test_one_line_per_request_with_outcomes(self):
        """Successes (plain and streamed, both endpoints), a prefill 4xx, a
        502 and a client that leaves: exactly one access line each, with the
        status the client saw."""
        def p(req):
            doc = req.json()
            prompt = doc.get("prompt") or doc["messages"][0]["content"]
            if prompt == "reject":
                return Respond(400, [("Content-Type", "application/json")],
                               b'{"error":{"message":"bad prompt","code":400}}')
            if prompt == "fail":
                return Respond(500, [("Content-Type", "application/json")], b'{}')
            if prompt == "hang":
                return Hang(8.0)
            return prefill_handler()(req)
        events = sse_events(["a", "bb", "ccc"])

        def d(req):
            if req.json().get("stream"):
                return Stream(200, [("Content-Type", "text/event-stream")],
                              [(0, e) for e in events])
            return decode_handler()(req)
        P = self.mock(p, "P")
        D = self.mock(d, "D")
        px = self.start_proxy([P], [D], threads=4,
                              extra=["--drain-delay", "0", "--prefill-retries", "0",
                                     "--unhealthy-after", "100", "--health-interval", "0"])
        expect = {}  # id -> (status, bytes of body or None)
        lock = threading.Lock()

        def run(rid, path, body):
            r = raw_exchange(px.port, "POST", path, body, headers=[("X-Request-Id", rid)])
            with lock:
                expect[rid] = (r.status, len(r.body))
        jobs = []
        for k in range(12):
            if k % 3 == 0:
                jobs.append(("ok-chat-%d" % k, "/v1/chat/completions", chat_body()))
            elif k % 3 == 1:
                jobs.append(("ok-stream-%d" % k, "/v1/completions", completion_body(stream=True)))
            else:
                jobs.append(("ok-cmpl-%d" % k, "/v1/completions", completion_body()))
        jobs.append(("rejected-1", "/v1/completions", completion_body(prompt="reject")))
        jobs.append(("failed-1", "/v1/completions", completion_body(prompt="fail")))
        ts = [threading.Thread(target=run, args=j) for j in jobs]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        # A client that leaves while P hangs.
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body(prompt="hang"),
                  headers=[("X-Request-Id", "left-1")])
        self.assertTrue(wait_until(lambda: any(r.header("x-request-id") == "left-1"
                                               for r in list(P.requests)), 5))
        c.close()
        ids = [j[0] for j in jobs] + ["left-1"]
        recs = self.wait_access(px, ids)
        for rid in ids:
            rec = self.one_line(recs, rid)
            self.check_fields(rec, rid)
            if rid == "left-1":
                self.assertNotEqual(rec["outcome"], "ok", rec)
                self.assertTrue(400 <= num(rec["status"]) < 600, rec)
                continue
            status, nbytes = expect[rid]
            self.assertEqual(num(rec["status"]), status, rec)
            if rid.startswith("ok-"):
                self.assertEqual(status, 200, rid)
                self.assertEqual(rec["outcome"], "ok", rec)
                self.assertEqual(num(rec["bytes_out"]), nbytes, rec)
                self.assertEqual(rec["endpoint"], "/v1/chat/completions" if "chat" in rid
                                 else "/v1/completions", rec)
                self.assertGreaterEqual(num(rec["ttfb_ms"]), num(rec["prefill_ms"]), rec)
                self.assertGreaterEqual(num(rec["total_ms"]), num(rec["ttfb_ms"]), rec)
            else:
                self.assertNotEqual(rec["outcome"], "ok", rec)
        self.assertEqual(expect["rejected-1"][0], 400)
        # A prefill 4xx relayed as it is: its body is what the client got.
        self.assertEqual(num(self.one_line(recs, "rejected-1")["bytes_out"]),
                         expect["rejected-1"][1], "bytes_out of a relayed prefill 4xx")
        self.assertEqual(expect["failed-1"][0], 502)
        self.assertEqual(len(self.access(px)), len(ids), "one access line per request")

    def test_generated_request_id_matches_response_header(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r)
        rid = r.header("x-request-id")
        self.assertTrue(rid, "no X-Request-Id in the answer")
        rec = self.one_line(self.wait_access(px, [rid]), rid)
        self.assertEqual(P.requests[0].header("x-request-id"), rid)
        self.assertEqual(num(rec["status"]), 200)

    def test_refused_api_requests_are_logged(self):
        # "One line per request": requests refused before any backend is
        # involved (bad key, wrong method, invalid JSON) are requests too.
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0", "--api-key", "k1"])
        sent = [("POST", "/v1/completions", completion_body(), [], 401, "refused-401"),
                ("GET", "/v1/completions", None, [("Authorization", "Bearer k1")], 405,
                 "refused-405"),
                ("POST", "/v1/completions", "{bad json", [("Authorization", "Bearer k1")], 400,
                 "refused-400")]
        for method, path, body, hs, want, rid in sent:
            r = raw_exchange(px.port, method, path, body, headers=hs + [("X-Request-Id", rid)])
            self.assertEqual(r.status, want, r)
        wait_until(lambda: len(self.access(px)) >= len(sent), 3)
        recs = self.access(px)
        missing = []
        for method, path, body, hs, want, rid in sent:
            mine = [r for r in recs if num(r.get("status")) == want]
            if not mine:
                missing.append("%s %s -> %d" % (method, path, want))
        self.assertFalse(missing, "no access line for: %s\nstderr:\n%s"
                         % (", ".join(missing), px.stderr()[-3000:]))

    def test_json_format(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        dead = closed_port()
        px = self.start_proxy([P], [D, dead], extra=["--drain-delay", "0", "--log-format",
                                                     "json", "--health-interval", "0"])
        ids = []
        for k in range(4):  # round robin: some go to the dead D first (warn lines)
            rid = "json-%d" % k
            ids.append(rid)
            r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                             headers={"X-Request-Id": rid})
            self.assertEqual(r.status, 200, r)
        recs = self.wait_access(px, ids, fmt="json")
        for rid in ids:
            rec = self.one_line(recs, rid)
            self.check_fields(rec, rid, fields=OK_FIELDS)
            self.assertEqual(num(rec["status"]), 200, rec)
            self.assertEqual(rec["outcome"], "ok", rec)
            self.assertEqual(rec["prefill"], "127.0.0.1:%d" % P.port, rec)
            self.assertEqual(rec["decode"], "127.0.0.1:%d" % D.port, rec)
            self.assertEqual(rec["endpoint"], "/v1/completions", rec)
            for f in ("prefill_ms", "ttfb_ms", "total_ms", "bytes_out"):
                self.assertGreaterEqual(num(rec[f]), 0, rec)
        self.assertTrue(any(r.get("level") in ("warn", "warning") for r in self.records(px, "json")),
                        "no warn line for the dead decode")
        self.stop(px)
        self.records(px, "json")  # every line, the last ones included, is JSON

    def unknowns_absent(self, rec, where):
        for f in ("prefill", "decode", "prefill_ms", "ttfb_ms"):
            self.assertNotIn(f, rec, "%s: %s is unknown, so absent: %r" % (where, f, rec))
        for k, v in rec.items():
            self.assertNotIn(v, (-1, -1.0, "-1", "-1.00", "-", ""),
                             "%s: %s=%r stands for 'none'" % (where, k, v))

    def test_json_values_typed_and_absent_when_unknown(self):
        """--log-format json: numbers are JSON numbers, text is strings, and
        what is not known (no prefill, no first byte) is absent rather than
        -1 or "-"."""
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0", "--log-format", "json"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers={"X-Request-Id": "typed-ok"})
        self.assertEqual(r.status, 200, r)
        r = raw_exchange(px.port, "POST", "/v1/completions", "{bad json",
                         headers=[("X-Request-Id", "typed-400")])
        self.assertEqual(r.status, 400, r)
        r = raw_exchange(px.port, "GET", "/v1/completions", None,
                         headers=[("X-Request-Id", "typed-405")])
        self.assertEqual(r.status, 405, r)
        recs = self.wait_access(px, ["typed-ok", "typed-400"], fmt="json")
        ok = self.one_line(recs, "typed-ok")
        self.check_fields(ok, "ok", fields=OK_FIELDS)
        for f in ("status", "bytes_out"):
            self.assertIs(type(ok[f]), int, "%s=%r" % (f, ok[f]))
        for f in ("prefill_ms", "ttfb_ms", "total_ms"):
            self.assertIn(type(ok[f]), (int, float), "%s=%r" % (f, ok[f]))
            self.assertGreaterEqual(ok[f], 0)
        for f in ("req", "endpoint", "prefill", "decode", "outcome", "trace_id", "level", "ts",
                  "msg"):
            self.assertIs(type(ok[f]), str, "%s=%r" % (f, ok[f]))
        self.assertRegex(ok["trace_id"], r"^[0-9a-f]{32}$")
        self.assertEqual(ok["status"], 200)
        bad = self.one_line(recs, "typed-400")
        self.check_fields(bad, "400")
        self.assertEqual(bad["status"], 400)
        self.assertIn(type(bad["total_ms"]), (int, float))
        self.unknowns_absent(bad, "400")
        refused = [rec for rec in self.access(px, "json") if rec.get("status") == 405]
        self.assertEqual(len(refused), 1, self.access(px, "json"))
        self.unknowns_absent(refused[0], "405")
        # A request id made of digits stays a string.
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers={"X-Request-Id": "12345"})
        self.assertEqual(r.status, 200, r)
        rec = self.one_line(self.wait_access(px, ["12345"], fmt="json"), "12345")
        self.assertEqual(rec["req"], "12345")

    def test_logfmt_absent_when_unknown(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0"])
        r = raw_exchange(px.port, "POST", "/v1/completions", "{bad json",
                         headers=[("X-Request-Id", "absent-400")])
        self.assertEqual(r.status, 400, r)
        rec = self.one_line(self.wait_access(px, ["absent-400"]), "absent-400")
        self.check_fields(rec, "400")
        self.unknowns_absent(rec, "400")

    def test_request_id_with_equals_signs_keeps_logfmt_valid(self):
        # Base64 request ids end in '='; the id must come back intact.
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0"])
        rid = "YWJjZGVm=="
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers={"X-Request-Id": rid})
        self.assertEqual(r.status, 200, r)
        wait_until(lambda: rid in px.stderr(), 5)
        lines = [l for l in self.lines(px) if rid in l and "total_ms" in l]
        self.assertEqual(len(lines), 1, px.stderr())
        try:
            rec = parse_logfmt(lines[0])
        except LogfmtError as e:
            self.fail("access line with X-Request-Id %r is not valid logfmt: %s" % (rid, e))
        self.assertEqual(rec["req"], rid)

    def test_hostile_request_id_cannot_forge_fields(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        for fmt in ("logfmt", "json"):
            px = self.start_proxy([P], [D], extra=["--drain-delay", "0", "--log-format", fmt])
            evil = 'x" status=999 outcome=forged y="\\'
            r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                             headers=[("X-Request-Id", evil)])
            self.assertEqual(r.status, 200, r)
            self.assertTrue(wait_until(lambda: self.access(px, fmt), 5), px.stderr())
            for rec in self.access(px, fmt):
                self.assertEqual(num(rec["status"]), 200, (fmt, rec))
                self.assertEqual(rec["outcome"], "ok", (fmt, rec))
            self.stop(px)


class LogLevelTest(LogTestBase):

    def test_warn_suppresses_info(self):
        mode = {"fail": False}

        def p(req):
            if mode["fail"]:
                return Respond(500, [("Content-Type", "application/json")], b"{}")
            return prefill_handler()(req)
        P = self.mock(p, "P")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0", "--log-level", "warn",
                                               "--prefill-retries", "0", "--health-interval", "0",
                                               "--unhealthy-after", "100"])
        for k in range(5):
            r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                             headers={"X-Request-Id": "quiet-%d" % k})
            self.assertEqual(r.status, 200, r)
        mode["fail"] = True
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers={"X-Request-Id": "loud-1"})
        self.assertEqual(r.status, 502, r)
        self.assertTrue(wait_until(lambda: "loud-1" in px.stderr(), 5),
                        "no warn line for a 502 at --log-level warn:\n" + px.stderr())
        recs = self.records(px)
        for rec in recs:
            if rec.get("msg") == "request":
                continue    # access lines have their own switch, --access-log
            self.assertIn(rec.get("level"), ("warn", "warning", "error"),
                          "line below warn at --log-level warn: %r" % rec)
        # Access logging does not depend on --log-level: every request has its line.
        self.wait_access(px, ["quiet-%d" % k for k in range(5)] + ["loud-1"])
        for rid in ["quiet-%d" % k for k in range(5)]:
            rec = self.one_line(self.access(px), rid)
            self.assertEqual(rec.get("level"), "info")
        self.assertFalse([r for r in recs if str(r.get("req", "")).startswith("quiet-")
                          and r.get("msg") != "request"],
                         "info lines of successful requests at --log-level warn")

    def test_access_log_switch(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        for args in (["--access-log=false"],):
            with self.subTest(args=args):
                px = self.start_proxy([P], [D], extra=["--drain-delay", "0"] + args)
                r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                                 headers={"X-Request-Id": "off-1"})
                self.assertEqual(r.status, 200, r)
                r = http_request(px.port, "GET", "/no/such/path")
                self.assertEqual(r.status, 404, r)
                self.stop(px)
                self.assertEqual(self.access(px), [], px.stderr())
                # Other info lines stay: the switch is about access lines only.
                self.assertIn('msg="listening"', px.stderr())

    def test_error_suppresses_warn(self):
        P = self.mock(lambda r: Respond(500, [("Content-Type", "application/json")], b"{}"), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0", "--log-level", "error",
                                               "--prefill-retries", "1", "--health-interval", "0"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 502, r)
        self.assertEqual(len(P.requests), 2)
        self.stop(px)
        for rec in self.records(px):
            if rec.get("msg") == "request":
                continue    # access lines: --access-log, not --log-level
            self.assertEqual(rec.get("level"), "error", rec)

    def test_json_fields_of_issue_27(self):
        """JSON: the start-up line's counts are numbers; an error answer
        logs the bytes it sent; a request to an unknown path logs the id
        echoed to the client; every access line has method and client."""
        P = self.mock(lambda r: Respond(500, [("Content-Type", "application/json")], b"{}"), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0", "--log-format", "json",
                                               "--prefill-retries", "0",
                                               "--health-interval", "0"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers={"X-Request-Id": "err-1"})
        self.assertEqual(r.status, 502, r)
        r404 = http_request(px.port, "GET", "/no/such/path")
        self.assertEqual(r404.status, 404, r404)
        rid404 = r404.header("x-request-id")
        self.assertTrue(rid404, "a 404 without X-Request-Id")
        recs = self.wait_access(px, ["err-1", rid404], fmt="json")
        start = [x for x in self.records(px, "json") if x.get("msg") == "listening"]
        self.assertEqual(len(start), 1, start)
        for k in ("threads", "pools", "prefill_backends", "decode_backends"):
            self.assertIsInstance(start[0].get(k), int, "%s in %r" % (k, start[0]))
        err = self.one_line(recs, "err-1")
        self.assertEqual(err["status"], 502)
        self.assertEqual(err["bytes_out"], len(r.body), err)
        self.assertGreater(err["bytes_out"], 0)
        nf = self.one_line(recs, rid404)
        self.assertEqual(nf["endpoint"], "other")
        self.assertEqual(nf["bytes_out"], len(r404.body), nf)
        for rec in (err, nf):
            self.assertEqual(rec.get("client"), "127.0.0.1", rec)
        self.assertEqual(err.get("method"), "POST")
        self.assertEqual(nf.get("method"), "GET")

    def test_default_is_info(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0"])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers={"X-Request-Id": "info-1"})
        self.assertEqual(r.status, 200)
        rec = self.one_line(self.wait_access(px, ["info-1"]), "info-1")
        self.assertEqual(rec.get("level"), "info")


SECRETS = {
    "api": "sk-front-7Hq2ZpA91xLwQe",
    "wrong": "sk-wrong-Lm3Nb8Vc6Xz1Qa",
    "upstream": "sk-upstream-Rt5Yu7Io9Pa2Sd",
    "env": "sk-openai-env-Gh4Jk6Lz8Xc0",
    "file1": "sk-file-one-Qw1Er3Ty5Ui7",
    "file2": "sk-file-two-As2Df4Gh6Jk8",
}


class SecretTest(LogTestBase):

    def assertNoSecret(self, text, where):
        for name, s in SECRETS.items():
            self.assertNotIn(s, text, "%s secret (%s) appears in %s" % (name, s, where))
            self.assertNotIn(s[6:], text, "part of the %s secret appears in %s" % (name, where))

    def key_file(self):
        fd, path = tempfile.mkstemp(prefix="pdproxy-keys-")
        with os.fdopen(fd, "w") as f:
            f.write("%s\n%s\n" % (SECRETS["file1"], SECRETS["file2"]))
        self.addCleanup(os.unlink, path)
        return path

    def exercise(self, px, P):
        statuses = []
        for auth in (SECRETS["api"], SECRETS["wrong"], SECRETS["file1"], None):
            hs = {"Authorization": "Bearer %s" % auth} if auth else {}
            statuses.append(http_request(px.port, "POST", "/v1/completions",
                                         completion_body(), headers=hs).status)
        return statuses

    def test_keys_never_in_stderr_debug(self):
        fail = {"n": 0}

        def p(req):
            fail["n"] += 1
            if fail["n"] % 2:  # every other prefill fails once: warn lines
                return Respond(500, [("Content-Type", "application/json")], b"{}")
            return prefill_handler()(req)
        P = self.mock(p, "P")
        D = self.mock(decode_handler(), "D")
        for fmt in ("logfmt", "json"):
            px = self.start_proxy([P], [D], env={"OPENAI_API_KEY": SECRETS["env"]},
                                  extra=["--drain-delay", "0", "--log-level", "debug",
                                         "--log-format", fmt, "--api-key", SECRETS["api"],
                                         "--api-key-file", self.key_file(),
                                         "--upstream-api-key", SECRETS["upstream"],
                                         "--unhealthy-after", "100"])
            st = self.exercise(px, P)
            self.assertEqual(st, [200, 401, 200, 401], fmt)
            self.stop(px)
            self.assertNoSecret(px.stderr(), "stderr (%s, debug)" % fmt)
            self.assertNoSecret(px.stdout(), "stdout")

    def test_forwarded_client_key_never_in_stderr(self):
        # No --upstream-api-key: the client's header is forwarded to P and D,
        # and still never logged.
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([P], [D], extra=["--drain-delay", "0", "--log-level", "debug",
                                               "--api-key", SECRETS["api"]])
        r = http_request(px.port, "POST", "/v1/completions", completion_body(),
                         headers={"Authorization": "Bearer %s" % SECRETS["api"]})
        self.assertEqual(r.status, 200, r)
        self.assertEqual(P.requests[-1].header("authorization"), "Bearer %s" % SECRETS["api"])
        self.stop(px)
        self.assertNoSecret(px.stderr(), "stderr")

    def test_print_config_hides_keys(self):
        kf = self.key_file()
        runs = [
            (["--api-key", SECRETS["api"], "--upstream-api-key", SECRETS["upstream"],
              "--api-key-file", kf], {}),
            ([], {"PDPROXY_API_KEY": SECRETS["api"], "PDPROXY_UPSTREAM_API_KEY":
                  SECRETS["upstream"], "PDPROXY_API_KEY_FILE": kf,
                  "OPENAI_API_KEY": SECRETS["env"]}),
        ]
        for args, env in runs:
            for fmt in ("logfmt", "json"):
                p = run_pdproxy(args + ["--log-format", fmt, "--print-config"], env=env)
                self.assertEqual(p.returncode, 0, p.stderr)
                self.assertIn("api-key", p.stdout + p.stderr, "no api-key entry in --print-config")
                self.assertNoSecret(p.stdout + p.stderr, "--print-config %r %r" % (args, env))


if __name__ == "__main__":
    main()
