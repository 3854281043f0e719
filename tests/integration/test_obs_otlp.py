#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Trace export (issue 16 item 5): OTLP/HTTP with the JSON encoding to a
local receiver that checks every payload against the OTLP JSON shape. One
server span per request with a client span for each of its prefill and decode
legs; the legs' span ids are the parent ids P and D received in
`traceparent`, so the engines' spans nest under the proxy's. Configured by
OTEL_* variables; sampling decides the trace-flags sent to the engines; a slow
or failing collector costs dropped (counted) spans, never request latency or
unbounded memory."""

import http.server
import json
import re
import threading
import time
import unittest

from pdharness.case import PxTestCase, main
from pdharness.client import http_request, raw_exchange
from pdharness.mocks import (Stream, chat_body, completion_body, decode_handler, default_p_kv,
                             prefill_handler, sse_events)
from pdharness.net import closed_port, wait_until
from pdharness.procs import run_pdproxy

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
TP_RE = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")


class ShapeError(AssertionError):
    pass


def _keys(obj, allowed, where, required=()):
    if not isinstance(obj, dict):
        raise ShapeError("%s: expected an object, got %r" % (where, obj))
    extra = set(obj) - set(allowed)
    if extra:
        raise ShapeError("%s: unknown fields %s" % (where, sorted(extra)))
    for k in required:
        if k not in obj:
            raise ShapeError("%s: %s missing" % (where, k))


def _uint64_str(v, where):
    # OTLP/JSON: 64-bit integers as decimal strings (numbers are accepted too).
    if isinstance(v, bool) or not isinstance(v, (str, int)) or not re.fullmatch(r"\d+", str(v)):
        raise ShapeError("%s: %r is not a uint64 as OTLP JSON spells it" % (where, v))
    n = int(v)
    if n >= 1 << 64:
        raise ShapeError("%s: %r overflows uint64" % (where, v))
    return n


def check_any_value(v, where):
    _keys(v, ("stringValue", "boolValue", "intValue", "doubleValue", "arrayValue",
              "kvlistValue", "bytesValue"), where)
    if len(v) != 1:
        raise ShapeError("%s: AnyValue must hold exactly one field: %r" % (where, v))
    k, x = next(iter(v.items()))
    if k == "stringValue" and not isinstance(x, str):
        raise ShapeError("%s: stringValue %r" % (where, x))
    if k == "boolValue" and not isinstance(x, bool):
        raise ShapeError("%s: boolValue %r" % (where, x))
    if k == "intValue" and not (isinstance(x, str) and re.fullmatch(r"-?\d+", x) or
                                isinstance(x, int) and not isinstance(x, bool)):
        raise ShapeError("%s: intValue %r" % (where, x))
    if k == "doubleValue" and not isinstance(x, (int, float)):
        raise ShapeError("%s: doubleValue %r" % (where, x))


def check_attributes(attrs, where):
    if not isinstance(attrs, list):
        raise ShapeError("%s: attributes must be a list" % where)
    seen = set()
    out = {}
    for i, a in enumerate(attrs):
        w = "%s.attributes[%d]" % (where, i)
        _keys(a, ("key", "value"), w, ("key", "value"))
        if not isinstance(a["key"], str) or not a["key"]:
            raise ShapeError("%s: key %r" % (w, a["key"]))
        if a["key"] in seen:
            raise ShapeError("%s: duplicate key %s" % (w, a["key"]))
        seen.add(a["key"])
        check_any_value(a["value"], w + ".value")
        k, x = next(iter(a["value"].items()))
        out[a["key"]] = int(x) if k == "intValue" else x
    return out


def check_export_request(doc):
    """Validates an ExportTraceServiceRequest in OTLP's JSON encoding (field
    names in lowerCamelCase, ids in hex, enums as integers); returns
    [(resource attributes, scope, span dict with parsed attributes)]."""
    _keys(doc, ("resourceSpans",), "request", ("resourceSpans",))
    out = []
    if not isinstance(doc["resourceSpans"], list) or not doc["resourceSpans"]:
        raise ShapeError("resourceSpans must be a non-empty list")
    for i, rs in enumerate(doc["resourceSpans"]):
        w = "resourceSpans[%d]" % i
        _keys(rs, ("resource", "scopeSpans", "schemaUrl"), w, ("scopeSpans",))
        res = {}
        if "resource" in rs:
            _keys(rs["resource"], ("attributes", "droppedAttributesCount"), w + ".resource")
            res = check_attributes(rs["resource"].get("attributes", []), w + ".resource")
        for j, ss in enumerate(rs["scopeSpans"]):
            w2 = "%s.scopeSpans[%d]" % (w, j)
            _keys(ss, ("scope", "spans", "schemaUrl"), w2, ("spans",))
            scope = ss.get("scope", {})
            _keys(scope, ("name", "version", "attributes", "droppedAttributesCount"), w2 + ".scope")
            for k, s in enumerate(ss["spans"]):
                w3 = "%s.spans[%d]" % (w2, k)
                _keys(s, ("traceId", "spanId", "traceState", "parentSpanId", "flags", "name",
                          "kind", "startTimeUnixNano", "endTimeUnixNano", "attributes",
                          "droppedAttributesCount", "events", "droppedEventsCount", "links",
                          "droppedLinksCount", "status"), w3,
                      ("traceId", "spanId", "name", "kind", "startTimeUnixNano",
                       "endTimeUnixNano"))
                if not HEX32.match(s["traceId"]) or s["traceId"] == "0" * 32:
                    raise ShapeError("%s: traceId %r" % (w3, s["traceId"]))
                if not HEX16.match(s["spanId"]) or s["spanId"] == "0" * 16:
                    raise ShapeError("%s: spanId %r" % (w3, s["spanId"]))
                if "parentSpanId" in s and not HEX16.match(s["parentSpanId"]):
                    raise ShapeError("%s: parentSpanId %r" % (w3, s["parentSpanId"]))
                if not isinstance(s["name"], str) or not s["name"]:
                    raise ShapeError("%s: name %r" % (w3, s["name"]))
                if s["kind"] not in (0, 1, 2, 3, 4, 5) or isinstance(s["kind"], bool):
                    raise ShapeError("%s: kind %r (an integer SpanKind)" % (w3, s["kind"]))
                t0 = _uint64_str(s["startTimeUnixNano"], w3 + ".startTimeUnixNano")
                t1 = _uint64_str(s["endTimeUnixNano"], w3 + ".endTimeUnixNano")
                if t1 < t0:
                    raise ShapeError("%s: ends before it starts" % w3)
                if "status" in s:
                    _keys(s["status"], ("code", "message"), w3 + ".status")
                    if s["status"].get("code", 0) not in (0, 1, 2):
                        raise ShapeError("%s: status.code %r" % (w3, s["status"]))
                attrs = check_attributes(s.get("attributes", []), w3)
                out.append((res, scope, dict(s, attrs=attrs, t0=t0, t1=t1)))
    return out


class ShapeSelfTest(unittest.TestCase):
    """The validator rejects what OTLP/JSON forbids (so the tests below can fail)."""

    GOOD = {"resourceSpans": [{"resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": "x"}}]},
        "scopeSpans": [{"scope": {"name": "s"}, "spans": [{
            "traceId": TRACE, "spanId": SPAN, "name": "n", "kind": 2,
            "startTimeUnixNano": "1", "endTimeUnixNano": "2",
            "attributes": [{"key": "a", "value": {"intValue": "3"}}], "status": {"code": 0}}]}]}]}

    def test_good(self):
        spans = check_export_request(self.GOOD)
        self.assertEqual(spans[0][2]["attrs"], {"a": 3})

    def test_bad(self):
        def mutate(f):
            d = json.loads(json.dumps(self.GOOD))
            f(d["resourceSpans"][0]["scopeSpans"][0]["spans"][0])
            return d
        bad = [
            mutate(lambda s: s.update(traceId="AA" * 16)),  # upper-case hex
            mutate(lambda s: s.update(spanId="0" * 16)),
            mutate(lambda s: s.update(kind="SPAN_KIND_SERVER")),
            mutate(lambda s: s.update(startTimeUnixNano="3")),  # after the end
            mutate(lambda s: s.update(trace_id=TRACE)),  # snake_case
            mutate(lambda s: s.update(attributes=[{"key": "a", "value": {"intValue": "x"}}])),
            mutate(lambda s: s.update(attributes=[{"key": "a", "value": "plain"}])),
            mutate(lambda s: s.update(parentSpanId="xyz")),
            mutate(lambda s: s.pop("name")),
            {"resourceSpans": []},
        ]
        for d in bad:
            with self.assertRaises(ShapeError, msg=json.dumps(d)[:200]):
                check_export_request(d)


class Receiver:
    """An OTLP/HTTP collector on 127.0.0.1: POST /v1/traces, JSON only.
    mode: 'ok' (200), 'fail' (503), 'slow' (answers after `delay` s)."""

    def __init__(self, mode="ok", delay=0.0):
        self.mode, self.delay = mode, delay
        self.spans, self.errors, self.posts = [], [], 0
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.release = threading.Event()
        rcv = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                try:
                    if self.path != "/v1/traces":
                        raise ShapeError("POST to %s, not /v1/traces" % self.path)
                    ct = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                    if ct != "application/json":
                        raise ShapeError("Content-Type %r" % ct)
                    spans = check_export_request(json.loads(body))
                    err = None
                except (ShapeError, ValueError) as e:
                    spans, err = [], "%s: %s" % (e, body[:300])
                with rcv.cond:
                    rcv.posts += 1
                    if err:
                        rcv.errors.append(err)
                    elif rcv.mode == "ok":
                        rcv.spans.extend(spans)
                    rcv.cond.notify_all()
                if rcv.mode == "slow":
                    rcv.release.wait(rcv.delay)
                code = 400 if err else 503 if rcv.mode == "fail" else 200
                out = b"{}"
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def of_trace(self, trace_id):
        with self.lock:
            return [s for (_, _, s) in self.spans if s["traceId"] == trace_id]

    def wait_spans(self, trace_id, n, timeout=5.0):
        wait_until(lambda: len(self.of_trace(trace_id)) >= n, timeout, 0.01)
        return self.of_trace(trace_id)


def tp_of(req):
    vals = req.header_all("traceparent")
    assert len(vals) == 1, vals
    m = TP_RE.match(vals[0])
    assert m, vals[0]
    return m.groups()


class OtlpTest(PxTestCase):

    def receiver(self, **kw):
        r = Receiver(**kw)
        self.addCleanup(r.stop)
        return r

    def otel_env(self, rcv, **extra):
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:%d" % rcv.port,
               "OTEL_SERVICE_NAME": "pdproxy-test", "OTEL_BSP_SCHEDULE_DELAY": "20"}
        env.update(extra)
        return env

    def start(self, rcv, p=None, d=None, **extra):
        self.P = p or self.mock(prefill_handler(), "P")
        self.D = d or self.mock(decode_handler(), "D")
        return self.start_proxy([self.P], [self.D], extra=["--drain-delay", "0"],
                                env=self.otel_env(rcv, **extra))

    def by_name(self, spans):
        """{server span name, "prefill", "decode": span}: client spans are named
        by their method (HTTP conventions), so their role tells them apart."""
        out = {}
        for s in spans:
            key = s["name"] if s["kind"] == 2 else s["attrs"].get("pdproxy.role")
            self.assertNotIn(key, out, "two spans for %s" % key)
            out[key] = s
        return out

    def test_http_and_genai_semantic_conventions(self):
        """Each attribute the OpenTelemetry HTTP conventions require (server
        span: http.request.method, url.path, url.scheme, http.route with a
        route, http.response.status_code, named "METHOD route"; client spans:
        named by the method, http.request.method, server.address the host
        alone, server.port, url.full), and the GenAI ones where usage is
        reported (gen_ai.operation.name, gen_ai.request.model,
        gen_ai.usage.input_tokens)."""
        rcv = self.receiver()
        px = self.start(rcv)
        for path, body, op in (("/v1/completions", completion_body(model="m-1"),
                                "text_completion"),
                               ("/v1/chat/completions", chat_body(model="m-1"), "chat")):
            with self.subTest(path=path):
                trace = "%032x" % (hash(path) & (2**128 - 1) or 1)
                r = raw_exchange(px.port, "POST", path, body,
                                 headers=[("traceparent", "00-%s-%s-01" % (trace, SPAN))])
                self.assertEqual(r.status, 200, r)
                s = self.by_name(rcv.wait_spans(trace, 3))
                root, p, d = s["POST " + path], s["prefill"], s["decode"]
                want_root = {"http.request.method": "POST", "http.route": path,
                             "url.path": path, "url.scheme": "http",
                             "http.response.status_code": 200,
                             "gen_ai.operation.name": op, "gen_ai.request.model": "m-1",
                             "gen_ai.usage.input_tokens": 3}
                for k, v in want_root.items():
                    self.assertEqual(root["attrs"].get(k), v, k)
                for leg, mock in ((p, self.P), (d, self.D)):
                    self.assertEqual(leg["name"], "POST")
                    want = {"http.request.method": "POST", "server.address": "127.0.0.1",
                            "server.port": mock.port,
                            "url.full": "http://127.0.0.1:%d%s" % (mock.port, path),
                            "http.response.status_code": 200,
                            "gen_ai.operation.name": op, "gen_ai.request.model": "m-1"}
                    for k, v in want.items():
                        self.assertEqual(leg["attrs"].get(k), v, "%s: %s" % (leg["name"], k))
                self.assertEqual(p["attrs"].get("gen_ai.usage.input_tokens"), 3)
        # A passed-through path: no route template, so the span is named by
        # the method, url.path without the query, no GenAI attributes.
        trace = "c" * 32
        r = raw_exchange(px.port, "POST", "/v1/embeddings?x=1", {"model": "m-1", "input": "a"},
                         headers=[("traceparent", "00-%s-%s-01" % (trace, SPAN))])
        s = [x for x in rcv.wait_spans(trace, 2) if x["kind"] == 2]
        self.assertEqual(len(s), 1, s)
        self.assertEqual(s[0]["name"], "POST")
        self.assertEqual(s[0]["attrs"].get("url.path"), "/v1/embeddings")
        self.assertNotIn("http.route", s[0]["attrs"])
        self.assertNotIn("gen_ai.operation.name", s[0]["attrs"])

    def test_request_spans_nest_engines_under_the_proxy(self):
        rcv = self.receiver()
        px = self.start(rcv, OTEL_RESOURCE_ATTRIBUTES="k8s.pod.name=px-1,"
                        "deployment.environment=test%20env,service.name=ignored")
        t_before = time.time_ns()
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                         headers=[("traceparent", "00-%s-%s-01" % (TRACE, SPAN)),
                                  ("X-Request-Id", "otlp-1")])
        self.assertEqual(r.status, 200, r)
        spans = rcv.wait_spans(TRACE, 3)
        self.assertFalse(rcv.errors, rcv.errors)
        self.assertEqual(len(spans), 3, spans)
        s = self.by_name(spans)
        self.assertEqual(set(s), {"POST /v1/completions", "prefill", "decode"})
        root, p, d = s["POST /v1/completions"], s["prefill"], s["decode"]
        # The client's span is the root's parent; the legs are the root's
        # children, with exactly the span ids the engines were handed.
        self.assertEqual(root.get("parentSpanId"), SPAN)
        self.assertEqual(root["kind"], 2)
        ptrace, pspan, pflags = tp_of(self.P.requests[-1])
        dtrace, dspan, dflags = tp_of(self.D.requests[-1])
        self.assertEqual((ptrace, dtrace), (TRACE, TRACE))
        self.assertEqual(p["spanId"], pspan, "prefill span id vs P's traceparent")
        self.assertEqual(d["spanId"], dspan, "decode span id vs D's traceparent")
        for leg in (p, d):
            self.assertEqual(leg.get("parentSpanId"), root["spanId"])
            self.assertEqual(leg["kind"], 3)
        self.assertEqual(len({root["spanId"], pspan, dspan, SPAN}), 4)
        # Attributes: backend, status, decision, remote_request_id, tokens.
        rrid = default_p_kv("otlp-1")["remote_request_id"]
        self.assertEqual(root["attrs"]["http.response.status_code"], 200)
        self.assertEqual(root["attrs"]["pdproxy.disaggregation"], "prefill_decode")
        self.assertEqual(root["attrs"]["pdproxy.request_id"], "otlp-1")
        self.assertEqual(root["attrs"]["pdproxy.remote_request_id"], rrid)
        self.assertEqual(p["attrs"]["server.address"], "127.0.0.1")
        self.assertEqual(p["attrs"]["server.port"], self.P.port)
        self.assertEqual(d["attrs"]["server.address"], "127.0.0.1")
        self.assertEqual(d["attrs"]["server.port"], self.D.port)
        self.assertEqual(p["attrs"]["http.response.status_code"], 200)
        self.assertEqual(d["attrs"]["http.response.status_code"], 200)
        self.assertEqual(p["attrs"]["pdproxy.remote_request_id"], rrid)
        self.assertEqual(d["attrs"]["pdproxy.remote_request_id"], rrid)
        self.assertEqual(p["attrs"]["gen_ai.usage.input_tokens"], 3)
        self.assertIs(d["attrs"]["pdproxy.stream"], False)
        # Time: the legs inside the request, prefill before decode, now-ish.
        t_after = time.time_ns()
        self.assertTrue(t_before - 10**9 <= root["t0"] <= p["t0"] <= p["t1"] <= d["t0"]
                        <= d["t1"] <= root["t1"] <= t_after + 10**9,
                        [(x["name"], x["t0"], x["t1"]) for x in (root, p, d)])
        res = rcv.spans[0][0]
        self.assertEqual(res.get("service.name"), "pdproxy-test")
        self.assertEqual(res.get("k8s.pod.name"), "px-1")
        self.assertEqual(res.get("deployment.environment"), "test env")

    def test_new_trace_streamed_and_decode_only(self):
        rcv = self.receiver()
        events = sse_events(["a", "b"])

        def d(req):
            if req.json().get("stream"):
                return Stream(200, [("Content-Type", "text/event-stream")],
                              [(0, e) for e in events])
            return decode_handler()(req)
        px = self.start(rcv, d=self.mock(d, "D"))
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(stream=True))
        self.assertEqual(r.status, 200, r)
        trace, pspan, flags = tp_of(self.P.requests[-1])
        self.assertEqual(flags, "01", "a new trace is sampled by default")
        s = self.by_name(rcv.wait_spans(trace, 3))
        self.assertEqual(len(s), 3, s)
        self.assertNotIn("parentSpanId", s["POST /v1/completions"], "a new trace has a root")
        self.assertIs(s["decode"]["attrs"]["pdproxy.stream"], True)
        self.assertEqual(s["prefill"]["spanId"], pspan)
        self.assertFalse(rcv.errors, rcv.errors)

    def test_no_prefill_is_an_error_span(self):
        rcv = self.receiver()
        dead = closed_port()
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([dead], [D], extra=["--drain-delay", "0", "--prefill-retries",
                                                  "0"], env=self.otel_env(rcv))
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                         headers=[("traceparent", "00-%s-%s-01" % (TRACE, SPAN))])
        self.assertEqual(r.status, 502, r)
        s = self.by_name(rcv.wait_spans(TRACE, 2))
        self.assertEqual(set(s), {"POST /v1/completions", "prefill"}, s)
        self.assertEqual(s["POST /v1/completions"]["status"]["code"], 2)
        self.assertEqual(s["prefill"]["status"]["code"], 2)
        self.assertEqual(s["POST /v1/completions"]["attrs"]["http.response.status_code"], 502)
        self.assertEqual(s["POST /v1/completions"]["attrs"]["error.type"], "502")
        self.assertIn("error.type", s["prefill"]["attrs"])

    def test_sampling_decides_export_and_engine_flags(self):
        rcv = self.receiver()
        px = self.start(rcv)
        # parentbased (the default): a client's unsampled trace stays unsampled.
        unsampled = "a" * 32
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                         headers=[("traceparent", "00-%s-%s-00" % (unsampled, SPAN))])
        self.assertEqual(r.status, 200, r)
        self.assertEqual(tp_of(self.P.requests[-1])[2], "00")
        r = raw_exchange(px.port, "POST", "/v1/completions", completion_body(),
                         headers=[("traceparent", "00-%s-%s-01" % (TRACE, SPAN))])
        self.assertEqual(r.status, 200, r)
        # Spans leave in order: once the second request's are in, the first's
        # would be too.
        self.assertEqual(len(rcv.wait_spans(TRACE, 3)), 3)
        self.assertEqual(rcv.of_trace(unsampled), [])

    def test_always_off_and_ratio_zero_sample_nothing(self):
        for sampler, arg in (("always_off", None), ("traceidratio", "0")):
            with self.subTest(sampler=sampler):
                rcv = self.receiver()
                extra = {"OTEL_TRACES_SAMPLER": sampler}
                if arg is not None:
                    extra["OTEL_TRACES_SAMPLER_ARG"] = arg
                px = self.start(rcv, **extra)
                r = raw_exchange(px.port, "POST", "/v1/completions", completion_body())
                self.assertEqual(r.status, 200, r)
                self.assertEqual(tp_of(self.P.requests[-1])[2], "00", sampler)
                self.assertEqual(tp_of(self.D.requests[-1])[2], "00", sampler)
                # Nothing was queued: the export counters say so after the
                # request ended (its spans are queued before its log line).
                m = http_request(px.port, "GET", "/metrics").body.decode()
                self.assertIn("pdproxy_trace_spans_queued 0\n", m)
                self.assertIn("pdproxy_trace_spans_exported_total 0\n", m)
                px._expected_exit = True
                self.assertEqual(px.stop(), 0)
                self.assertEqual(rcv.posts, 0, "%s: spans were exported" % sampler)

    def test_slow_collector_drops_and_counts_never_delays(self):
        rcv = self.receiver(mode="slow", delay=3.0)
        px = self.start(rcv, OTEL_BSP_MAX_QUEUE_SIZE="6", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="3",
                        OTEL_EXPORTER_OTLP_TIMEOUT="2000")
        t0 = time.monotonic()
        for _ in range(20):
            r = http_request(px.port, "POST", "/v1/completions", completion_body())
            self.assertEqual(r.status, 200, r)
        elapsed = time.monotonic() - t0
        # Blocked behind the collector, each request would wait for an
        # export to time out (2 s) to make room: 20 of them, half a minute.
        self.assertLess(elapsed, 10.0, "requests waited for the collector")
        m = http_request(px.port, "GET", "/metrics").body.decode()
        dropped = int(re.search(r'pdproxy_trace_spans_dropped_total\{reason="queue_full"\} (\d+)',
                                m).group(1))
        queued = int(re.search(r"pdproxy_trace_spans_queued (\d+)", m).group(1))
        # 60 spans: 6 fit in the queue, and each export cycle (at most
        # 2 s, the timeout) takes a batch of 3 out of it.
        cycles = int(elapsed / 2.0) + 1
        self.assertGreaterEqual(dropped, 60 - 6 - 3 * cycles, m)
        self.assertGreater(dropped, 0, m)
        self.assertLessEqual(queued, 6, m)
        rcv.release.set()

    def test_failing_collector_counted(self):
        rcv = self.receiver(mode="fail")
        px = self.start(rcv)
        for _ in range(3):
            self.assertEqual(http_request(px.port, "POST", "/v1/completions",
                                          completion_body()).status, 200)

        def failed():
            m = http_request(px.port, "GET", "/metrics").body.decode()
            v = re.search(r'pdproxy_trace_spans_dropped_total\{reason="export_failed"\} (\d+)', m)
            return int(v.group(1)) if v else 0
        self.assertTrue(wait_until(lambda: failed() >= 9, 5, 0.02), failed())
        self.assertIn("trace export failed", px.stderr())
        self.assertFalse(rcv.errors, rcv.errors)

    def test_bad_settings_refused(self):
        for k, v in (("OTEL_TRACES_SAMPLER", "sometimes"),
                     ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
                     ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                     ("OTEL_BSP_MAX_QUEUE_SIZE", "0")):
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
                   "OTEL_TRACES_SAMPLER": "traceidratio", k: v}
            p = run_pdproxy(["--prefill", "http://127.0.0.1:1", "--decode",
                             "http://127.0.0.1:2", "--port", "1"], env=env)
            self.assertEqual(p.returncode, 2, (k, v, p.stderr))
            self.assertIn(k, p.stderr, (k, v))


if __name__ == "__main__":
    main()
