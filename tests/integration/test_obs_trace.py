#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""W3C trace context (issue 6 item 3): a client's traceparent reaches P and D
as child spans of the same trace (same trace id and flags, a new parent id
each); a fresh one is generated when it is absent or invalid (the cases of the
W3C trace-context test suite), shared by P and D; tracestate passes through."""

import re

from pdharness.case import PxTestCase, main
from pdharness.client import raw_exchange
from pdharness.mocks import chat_body, completion_body, decode_handler, prefill_handler

TP_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def tp(trace=TRACE, span=SPAN, flags="01", version="00"):
    return "%s-%s-%s-%s" % (version, trace, span, flags)


class TraceTest(PxTestCase):

    def setUp(self):
        super().setUp()
        self.P = self.mock(prefill_handler(), "P")
        self.D = self.mock(decode_handler(), "D")
        self.px = self.start_proxy([self.P], [self.D], extra=["--drain-delay", "0"])
        self.n = 0

    def send(self, headers, path="/v1/completions", body=None):
        """One request; returns (P's request, D's request)."""
        self.n += 1
        body = body or (chat_body() if "chat" in path else completion_body())
        r = raw_exchange(self.px.port, "POST", path, body, headers=headers)
        self.assertEqual(r.status, 200, r)
        ps = self.P.wait_requests(self.n)
        ds = self.D.wait_requests(self.n)
        self.assertEqual(len(ps), self.n)
        self.assertEqual(len(ds), self.n)
        return ps[-1], ds[-1]

    def parsed(self, req, role):
        vals = req.header_all("traceparent")
        self.assertEqual(len(vals), 1, "%s got traceparent headers %r" % (role, vals))
        m = TP_RE.match(vals[0])
        self.assertTrue(m, "%s got an invalid traceparent %r" % (role, vals[0]))
        trace, span, flags = m.groups()
        self.assertNotEqual(trace, "0" * 32, role)
        self.assertNotEqual(span, "0" * 16, role)
        return trace, span, flags

    def assertChild(self, headers, flags="01", path="/v1/completions"):
        p, d = self.send(headers, path)
        pt, ps, pf = self.parsed(p, "P")
        dt, ds, df = self.parsed(d, "D")
        self.assertEqual(pt, TRACE, "P's trace id")
        self.assertEqual(dt, TRACE, "D's trace id")
        self.assertNotEqual(ps, SPAN, "P's parent id is the client's span, not a child's")
        self.assertNotEqual(ds, SPAN, "D's parent id is the client's span, not a child's")
        self.assertNotEqual(ps, ds, "P and D got the same span id")
        self.assertEqual(pf, flags, "P's flags")
        self.assertEqual(df, flags, "D's flags")
        return ps, ds

    def assertRestarted(self, headers, what, shared=False):
        """An invalid or absent traceparent: P and D get a fresh, valid one
        (with shared=True: one trace for both, as they serve one request)."""
        p, d = self.send(headers)
        pt, ps, pf = self.parsed(p, "P (%s)" % what)
        dt, ds, df = self.parsed(d, "D (%s)" % what)
        self.assertNotEqual(pt, TRACE, "%s: P continued the client's trace" % what)
        self.assertNotEqual(dt, TRACE, "%s: D continued the client's trace" % what)
        self.assertNotEqual(ps, SPAN, what)
        self.assertNotEqual(ds, SPAN, what)
        self.assertNotEqual(ps, ds, what)
        if shared:
            self.assertEqual(pt, dt, "%s: P and D got different trace ids for one request "
                                     "(P %r, D %r)" % (what, p.header("traceparent"),
                                                       d.header("traceparent")))
        return pt

    # -- continuing a client's trace

    def test_child_of_client_span(self):
        spans = set()
        for path in ("/v1/completions", "/v1/chat/completions"):
            ps, ds = self.assertChild([("traceparent", tp())], path=path)
            spans |= {ps, ds}
        self.assertEqual(len(spans), 4, "span ids reused across requests")

    def test_models_request_to_decode(self):
        r = raw_exchange(self.px.port, "GET", "/v1/models", headers=[("traceparent", tp())])
        self.assertEqual(r.status, 200, r)
        d = self.D.wait_requests(1)[-1]
        self.assertEqual(d.path, "/v1/models")
        trace, span, flags = self.parsed(d, "D (/v1/models)")
        self.assertEqual((trace, flags), (TRACE, "01"))
        self.assertNotEqual(span, SPAN)

    def test_flags_kept(self):
        self.assertChild([("traceparent", tp(flags="00"))], flags="00")
        self.assertChild([("traceparent", tp(flags="01"))], flags="01")

    def test_ows_around_value(self):
        # Header values lose optional white space: this is a valid traceparent.
        self.assertChild([("traceparent", " \t" + tp() + " \t")])

    def test_tracestate_passed_through(self):
        ts = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
        p, d = self.send([("traceparent", tp()), ("tracestate", ts)])
        self.assertEqual(p.header_all("tracestate"), [ts])
        self.assertEqual(d.header_all("tracestate"), [ts])
        # 32 members, 512 characters: what every vendor must propagate.
        long_ts = ",".join("k%02d=%s" % (i, "v" * 11) for i in range(32))
        long_ts = long_ts + "x" * (512 - len(long_ts))
        self.assertEqual(len(long_ts), 512)
        p, d = self.send([("traceparent", tp()), ("tracestate", long_ts)])
        self.assertEqual(p.header_all("tracestate"), [long_ts])
        self.assertEqual(d.header_all("tracestate"), [long_ts])
        # No tracestate from the client: none invented.
        p, d = self.send([("traceparent", tp())])
        self.assertEqual(p.header_all("tracestate"), [])
        self.assertEqual(d.header_all("tracestate"), [])

    # -- starting a new trace

    def test_generated_when_absent(self):
        traces = set()
        for _ in range(4):
            traces.add(self.assertRestarted([], "no traceparent"))
        self.assertEqual(len(traces), 4, "a generated trace id reused across requests")

    def test_generated_trace_is_shared_by_p_and_d(self):
        # P and D serve one request: one trace, two child spans.
        self.assertRestarted([], "no traceparent", shared=True)
        self.assertRestarted([("traceparent", "garbage")], "invalid traceparent", shared=True)

    def test_restart_on_invalid(self):
        # The invalid cases of the W3C trace-context test suite (test/test.py).
        t, s = TRACE, SPAN
        cases = {
            "version ff": "ff-%s-%s-01" % (t, s),
            "version illegal chars .0": ".0-%s-%s-01" % (t, s),
            "version illegal chars 0.": "0.-%s-%s-01" % (t, s),
            "version too long": "000-%s-%s-01" % (t, s),
            "version too short": "0-%s-%s-01" % (t, s),
            "version 00 with trailing data": "00-%s-%s-01-what-the-future-will-be-like" % (t, s),
            "version 00 with a trailing dot": "00-%s-%s-01." % (t, s),
            "trace id all zero": "00-%s-%s-01" % ("0" * 32, s),
            "trace id illegal chars": "00-%s.-%s-01" % (t[:31], s),
            "trace id upper case": "00-%s-%s-01" % (t.upper(), s),
            "trace id too long": "00-%s0-%s-01" % (t, s),
            "trace id too short": "00-%s-%s-01" % (t[:31], s),
            "parent id all zero": "00-%s-%s-01" % (t, "0" * 16),
            "parent id illegal chars": "00-%s-%s.-01" % (t, s[:15]),
            "parent id too long": "00-%s-%s0-01" % (t, s),
            "parent id too short": "00-%s-%s-01" % (t, s[:15]),
            "flags illegal chars": "00-%s-%s-.0" % (t, s),
            "flags too long": "00-%s-%s-001" % (t, s),
            "flags too short": "00-%s-%s-1" % (t, s),
            "empty": "",
            "garbage": "not a traceparent",
        }
        failures = []
        for what, value in cases.items():
            try:
                self.assertRestarted([("traceparent", value)] if value else
                                     [("traceparent", "")], what)
            except AssertionError as e:
                failures.append("%s (sent %r): %s" % (what, value, str(e).splitlines()[0]))
        self.assertFalse(failures, "invalid traceparents not restarted:\n  " +
                         "\n  ".join(failures))

    def test_restart_on_duplicated_traceparent(self):
        # W3C test suite: two traceparent headers make the context invalid.
        other = tp(trace="12345678901234567890123456789012", span="1234567890123456")
        self.assertRestarted([("traceparent", tp()), ("traceparent", other)], "duplicated")

    def test_future_version_is_continued(self):
        # A higher version with trailing fields is parsed as version 00 and
        # continued (W3C: "vendors MUST try to parse"); what is sent on is 00.
        for v in ("cc-%s-%s-01" % (TRACE, SPAN),
                  "cc-%s-%s-01-what-the-future-will-be-like" % (TRACE, SPAN)):
            with self.subTest(traceparent=v):
                self.assertChild([("traceparent", v)])

    def test_future_version_bad_separator_restarts(self):
        self.assertRestarted([("traceparent", "cc-%s-%s-01.what-the-future-will-be-like"
                               % (TRACE, SPAN))], "version cc, '.' after the flags")


if __name__ == "__main__":
    main()
