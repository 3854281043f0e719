#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""GET /metrics (issue 6 item 1): the Prometheus text exposition format
(0.0.4) parsed strictly, the families the issue names, and their values moving
as requests flow through several worker threads: request counts and
histograms, missing kv_transfer_params / remote_request_id counters, client
disconnects by phase, in-flight gauges while a backend hangs, prefill retries,
backend_up after an ejection, and the process metrics."""

import math
import os
import re
import threading
import time
import unittest

from pdharness.case import PxTestCase, main
from pdharness.client import RawClient, http_request
from pdharness.mocks import (Hang, Respond, Stream, chat_body, completion_body, decode_handler,
                             default_p_kv, prefill_handler, sse_events)
from pdharness.net import closed_port, wait_until
from pdharness.procs import run_pdproxy

# --------------------------------------------------------------------------
# A strict parser of the text exposition format, version 0.0.4
# (https://prometheus.io/docs/instrumenting/exposition_formats/).

METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Go's ParseFloat as Prometheus uses it, restricted to what exporters write.
VALUE_RE = re.compile(r"^(?:[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|"
                      r"[+-]Inf|NaN)$")
TIMESTAMP_RE = re.compile(r"^-?[0-9]+$")
TYPES = ("counter", "gauge", "histogram", "summary", "untyped")


class ExpositionError(AssertionError):
    pass


def _parse_value(s, where):
    if not VALUE_RE.match(s):
        raise ExpositionError("%s: bad sample value %r" % (where, s))
    return float(s)


def _unescape_help(s, where):
    out = []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            if i + 1 >= len(s) or s[i + 1] not in "\\n":
                raise ExpositionError("%s: bad escape in HELP %r" % (where, s))
            out.append("\\" if s[i + 1] == "\\" else "\n")
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _parse_labels(line, i, where):
    """Parses '{...}' starting at line[i] == '{'; returns (labels dict, index after '}')."""
    assert line[i] == "{"
    i += 1
    labels = {}
    for _ in range(10000):
        while i < len(line) and line[i] in " \t":
            i += 1
        if i < len(line) and line[i] == "}":
            return labels, i + 1
        m = LABEL_NAME_RE.match(line, i)
        if not m:
            raise ExpositionError("%s: bad label name at column %d" % (where, i))
        name = m.group(0)
        if name.startswith("__"):
            raise ExpositionError("%s: reserved label name %r" % (where, name))
        if name in labels:
            raise ExpositionError("%s: duplicate label %r" % (where, name))
        i = m.end()
        while i < len(line) and line[i] in " \t":
            i += 1
        if i >= len(line) or line[i] != "=":
            raise ExpositionError("%s: '=' expected after label %r" % (where, name))
        i += 1
        while i < len(line) and line[i] in " \t":
            i += 1
        if i >= len(line) or line[i] != '"':
            raise ExpositionError("%s: '\"' expected for label %r" % (where, name))
        i += 1
        val = []
        for _ in range(len(line) + 1):
            if i >= len(line):
                raise ExpositionError("%s: unterminated label value" % where)
            c = line[i]
            if c == "\\":
                if i + 1 >= len(line) or line[i + 1] not in '\\"n':
                    raise ExpositionError("%s: bad escape in label value" % where)
                val.append({"\\": "\\", '"': '"', "n": "\n"}[line[i + 1]])
                i += 2
                continue
            if c == '"':
                i += 1
                break
            val.append(c)
            i += 1
        labels[name] = "".join(val)
        while i < len(line) and line[i] in " \t":
            i += 1
        if i < len(line) and line[i] == ",":
            i += 1
            continue
        if i < len(line) and line[i] == "}":
            return labels, i + 1
        raise ExpositionError("%s: ',' or '}' expected in label set" % where)
    raise ExpositionError("%s: label set too long" % where)


class Exposition:
    """families: name -> {"type", "help", "samples": [(sample name, labels, value)]}.
    values: (sample name, frozenset(labels.items())) -> value."""

    def __init__(self):
        self.families = {}
        self.values = {}

    def get(self, name, **labels):
        return self.values.get((name, frozenset(labels.items())))

    def samples(self, name):
        return [(lab, v) for n, lab, v in self._all() if n == name]

    def _all(self):
        for f in self.families.values():
            for s in f["samples"]:
                yield s

    def family_of(self, sample_name):
        if sample_name in self.families:
            return sample_name
        for suf in ("_bucket", "_sum", "_count"):
            if sample_name.endswith(suf):
                base = sample_name[:-len(suf)]
                f = self.families.get(base)
                if f and f["type"] in ("histogram", "summary") and \
                        (suf != "_bucket" or f["type"] == "histogram"):
                    return base
        return None


def parse_exposition(text):
    """Parses `text` strictly; raises ExpositionError on anything the format forbids."""
    if text and not text.endswith("\n"):
        raise ExpositionError("the last line does not end with a line feed")
    if "\r" in text:
        raise ExpositionError("carriage return in the exposition")
    exp = Exposition()
    started = set()  # families whose samples have begun
    current = None  # the family whose group of lines we are in
    closed = set()  # families whose group ended (must not reappear)

    def enter(fam, where):
        nonlocal current
        if fam != current:
            if fam in closed:
                raise ExpositionError("%s: lines of family %r are not grouped together" % (where, fam))
            if current is not None:
                closed.add(current)
            current = fam

    lines = text.split("\n")[:-1] if text else []
    for ln, line in enumerate(lines, 1):
        where = "line %d %r" % (ln, line[:120])
        if line.strip(" \t") == "":
            continue
        if line.startswith("#"):
            parts = line.split(None, 3) if line.startswith("# ") else []
            if len(parts) >= 2 and parts[1] in ("HELP", "TYPE"):
                if len(parts) < 3 or not METRIC_NAME_RE.fullmatch(parts[2]):
                    raise ExpositionError("%s: bad metric name in %s" % (where, parts[1]))
                name = parts[2]
                f = exp.families.setdefault(name, {"type": None, "help": None, "samples": []})
                enter(name, where)
                if name in started:
                    raise ExpositionError("%s: %s after the family's samples" % (where, parts[1]))
                if parts[1] == "HELP":
                    if f["help"] is not None:
                        raise ExpositionError("%s: second HELP for %s" % (where, name))
                    # "# HELP name" + one blank + docstring (may be empty).
                    rest = line[len("# HELP ") + len(name):]
                    f["help"] = _unescape_help(rest[1:] if rest.startswith((" ", "\t")) else rest,
                                               where)
                else:
                    if f["type"] is not None:
                        raise ExpositionError("%s: second TYPE for %s" % (where, name))
                    if len(parts) != 4 or parts[3].strip(" \t") not in TYPES:
                        raise ExpositionError("%s: bad TYPE" % where)
                    f["type"] = parts[3].strip(" \t")
            continue  # any other comment
        m = METRIC_NAME_RE.match(line)
        if not m:
            raise ExpositionError("%s: bad metric name" % where)
        sname = m.group(0)
        i = j = m.end()
        while j < len(line) and line[j] in " \t":
            j += 1
        labels = {}
        if j < len(line) and line[j] == "{":
            labels, i = _parse_labels(line, j, where)
        rest = line[i:]
        if not rest or rest[0] not in " \t":
            raise ExpositionError("%s: blank expected before the value" % where)
        toks = rest.split()
        if len(toks) not in (1, 2):
            raise ExpositionError("%s: value [timestamp] expected, got %r" % (where, rest))
        value = _parse_value(toks[0], where)
        if len(toks) == 2 and not TIMESTAMP_RE.match(toks[1]):
            raise ExpositionError("%s: bad timestamp %r" % (where, toks[1]))
        fam = exp.family_of(sname)
        if fam is None or exp.families[fam]["type"] is None:
            raise ExpositionError("%s: sample without a TYPE line for its family" % where)
        enter(fam, where)
        started.add(fam)
        ftype = exp.families[fam]["type"]
        if "le" in labels and not (ftype == "histogram" and sname == fam + "_bucket"):
            raise ExpositionError("%s: label 'le' outside a histogram bucket" % where)
        if ftype == "histogram" and sname == fam:
            raise ExpositionError("%s: histogram sample without _bucket/_sum/_count" % where)
        key = (sname, frozenset(labels.items()))
        if key in exp.values:
            raise ExpositionError("%s: duplicate sample" % where)
        exp.values[key] = value
        exp.families[fam]["samples"].append((sname, labels, value))
    _check_families(exp)
    return exp


def _check_families(exp):
    for name, f in exp.families.items():
        if f["type"] is None and f["samples"]:
            raise ExpositionError("%s: samples without TYPE" % name)
        if f["type"] == "counter":
            for _, lab, v in f["samples"]:
                if not (v >= 0) or math.isinf(v):
                    raise ExpositionError("counter %s%r has value %r" % (name, lab, v))
        if f["type"] != "histogram":
            continue
        groups = {}
        for sname, lab, v in f["samples"]:
            rest = frozenset((k, x) for k, x in lab.items() if k != "le")
            g = groups.setdefault(rest, {"buckets": [], "sum": None, "count": None})
            if sname == name + "_bucket":
                if "le" not in lab:
                    raise ExpositionError("%s_bucket without le" % name)
                g["buckets"].append((_parse_value(lab["le"], "%s le" % name), v, lab["le"]))
            elif sname == name + "_sum":
                g["sum"] = v
            else:
                g["count"] = v
        for rest, g in groups.items():
            where = "histogram %s%s" % (name, dict(rest))
            if g["count"] is None or g["sum"] is None:
                raise ExpositionError("%s: _count or _sum missing" % where)
            b = g["buckets"]
            if not b or not math.isinf(b[-1][0]) or b[-1][0] < 0:
                raise ExpositionError("%s: the last bucket is not le=\"+Inf\"" % where)
            for j in range(1, len(b)):
                if not b[j][0] > b[j - 1][0]:
                    raise ExpositionError("%s: le not strictly increasing: %r" % (where, b))
                if b[j][1] < b[j - 1][1]:
                    raise ExpositionError("%s: buckets not cumulative: %r" % (where, b))
            for le, v, _ in b:
                if v < 0 or v != int(v):
                    raise ExpositionError("%s: bucket count %r" % (where, v))
            if b[-1][1] != g["count"]:
                raise ExpositionError("%s: le=+Inf bucket %r != _count %r"
                                      % (where, b[-1][1], g["count"]))
            if g["count"] != int(g["count"]) or g["count"] < 0 or not g["sum"] >= 0:
                raise ExpositionError("%s: _count %r _sum %r" % (where, g["count"], g["sum"]))


def assert_monotonic(before, after):
    """Every counter and histogram sample of `before` is in `after` and not smaller."""
    for (sname, labs), v in before.values.items():
        fam = before.family_of(sname)
        if before.families[fam]["type"] not in ("counter", "histogram", "summary"):
            continue
        if before.families[fam]["type"] == "summary" and sname == fam:
            continue  # quantiles may go down
        w = after.values.get((sname, labs))
        if w is None:
            raise ExpositionError("counter %s%s vanished between scrapes" % (sname, dict(labs)))
        if w < v:
            raise ExpositionError("counter %s%s decreased: %r -> %r" % (sname, dict(labs), v, w))


class ParserSelfTest(unittest.TestCase):
    """The parser rejects what the format forbids (so the tests below can fail)."""

    GOOD = ('# HELP a_total Some "help" with \\\\ and \\n.\n# TYPE a_total counter\n'
            'a_total{x="q\\"\\\\\\n",y="2",} 3\n'
            '# TYPE h histogram\nh_bucket{le="0.5"} 1\nh_bucket{le="+Inf"} 2\nh_sum 0.7\nh_count 2\n')

    def test_good(self):
        e = parse_exposition(self.GOOD)
        self.assertEqual(e.get("a_total", x='q"\\\n', y="2"), 3.0)
        self.assertEqual(e.families["a_total"]["help"], 'Some "help" with \\ and \n.')

    def test_bad(self):
        bad = [
            "a 1\n",  # no TYPE
            "# TYPE a counter\na 1",  # no final LF
            "# TYPE a counter\na{x=\"1\"} 1\n# HELP a late\n",  # HELP after samples
            "# TYPE a counter\n# TYPE a counter\na 1\n",
            "# TYPE a counter\na{x=\"\\t\"} 1\n",  # bad escape
            "# TYPE a counter\na{x=\"1\",x=\"2\"} 1\n",
            "# TYPE a counter\na{1x=\"1\"} 1\n",
            "# TYPE a counter\na 1\na 2\n",  # duplicate
            "# TYPE a counter\na -1\n",
            "# TYPE a counter\na one\n",
            "# TYPE a counter\n# TYPE b gauge\nb 1\na 1\n",  # not grouped
            "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
            "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 3\n",
            "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",  # no +Inf
            "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n",  # no _sum
            "# TYPE a counter\na{__x=\"1\"} 1\n",
            "# TYPE a counter\na{x=\"1\"}1\n",
            "# TYPE 9a counter\n",
            "# TYPE a countr\na 1\n",
        ]
        for text in bad:
            with self.assertRaises(ExpositionError, msg=repr(text)):
                parse_exposition(text)

    def test_monotonic(self):
        a = parse_exposition("# TYPE a counter\na 2\n")
        b = parse_exposition("# TYPE a counter\na 1\n")
        with self.assertRaises(ExpositionError):
            assert_monotonic(a, b)


# --------------------------------------------------------------------------

HIST = ("pdproxy_request_duration_seconds", "pdproxy_time_to_first_byte_seconds",
        "pdproxy_prefill_duration_seconds")


def be(mock):
    return "127.0.0.1:%d" % mock.port


class MetricsTest(PxTestCase):

    def scrape(self, proxy, prev=None):
        r = http_request(proxy.port, "GET", "/metrics")
        self.assertEqual(r.status, 200, r)
        ct = r.header("content-type") or ""
        self.assertTrue(re.match(r"^text/plain; ?version=0\.0\.4(;|$)", ct),
                        "Content-Type %r" % ct)
        text = r.body.decode("utf-8")  # must be UTF-8
        try:
            exp = parse_exposition(text)
        except ExpositionError as e:
            self.fail("exposition invalid: %s\n---\n%s" % (e, text[:6000]))
        if prev is not None:
            try:
                assert_monotonic(prev, exp)
            except ExpositionError as e:
                self.fail(str(e))
        return exp

    def val(self, exp, name, **labels):
        v = exp.get(name, **labels)
        return 0.0 if v is None else v

    def total(self, exp, name, **labels):
        """Sum of the samples of `name` whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for lab, v in exp.samples(name) if want <= set(lab.items()))

    def delta_all(self, before, after, name, **labels):
        return self.total(after, name, **labels) - self.total(before, name, **labels)

    def wait_metric(self, proxy, pred, timeout=5.0):
        """Scrape until pred(exp) is true; returns the last scrape."""
        box = {}

        def f():
            box["e"] = self.scrape(proxy, box.get("e"))
            return pred(box["e"])
        wait_until(f, timeout, 0.05)
        return box["e"]

    def start(self, p, d, extra=(), threads=4):
        return self.start_proxy([p], [d], extra=["--drain-delay", "0"] + list(extra),
                                threads=threads)

    def test_families_and_types(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start(P, D)
        e = self.scrape(px)
        want = {
            "pdproxy_requests_total": "counter",
            "pdproxy_request_duration_seconds": "histogram",
            "pdproxy_time_to_first_byte_seconds": "histogram",
            "pdproxy_prefill_duration_seconds": "histogram",
            "pdproxy_upstream_requests_total": "counter",
            "pdproxy_backend_up": "gauge",
            "pdproxy_backend_inflight": "gauge",
            "pdproxy_kv_transfer_params_missing_total": "counter",
            "pdproxy_remote_request_id_missing_total": "counter",
            "pdproxy_client_disconnects_total": "counter",
            "pdproxy_retries_total": "counter",
            "process_resident_memory_bytes": "gauge",
            "process_open_fds": "gauge",
            "process_cpu_seconds_total": "counter",
        }
        for name, t in want.items():
            self.assertIn(name, e.families, "family %s missing" % name)
            self.assertEqual(e.families[name]["type"], t, name)
            self.assertTrue(e.families[name]["help"], "no HELP for %s" % name)
        # Every labelled family carries the labels the issue names.
        for role, m in (("prefill", P), ("decode", D)):
            self.assertEqual(e.get("pdproxy_backend_up", role=role, backend=be(m)), 1.0,
                             "backend_up %s %s" % (role, be(m)))
            self.assertEqual(e.get("pdproxy_backend_inflight", role=role, backend=be(m)), 0.0)
        for role in ("prefill", "decode"):
            self.assertIsNotNone(e.get("pdproxy_retries_total", role=role), role)
        for phase in ("prefill", "decode", "stream"):
            self.assertIsNotNone(e.get("pdproxy_client_disconnects_total", phase=phase), phase)
        self.assertIsNotNone(e.get("pdproxy_kv_transfer_params_missing_total"))
        self.assertIsNotNone(e.get("pdproxy_remote_request_id_missing_total"))
        for lab, _ in e.samples("pdproxy_requests_total"):
            self.assertEqual(set(lab), {"endpoint", "code"}, lab)
        for lab, _ in e.samples("pdproxy_upstream_requests_total"):
            self.assertEqual(set(lab), {"role", "backend", "outcome"}, lab)
        # The scrape itself is a request.
        self.assertGreaterEqual(self.val(e, "pdproxy_requests_total", endpoint="/metrics",
                                         code="200"), 1)
        # Process metrics against /proc.
        pid = px.proc.pid
        with open("/proc/%d/statm" % pid) as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        got = e.get("process_resident_memory_bytes")
        self.assertTrue(rss / 3 <= got <= rss * 3, "RSS %r vs /proc %r" % (got, rss))
        nfd = len(os.listdir("/proc/%d/fd" % pid))
        got = e.get("process_open_fds")
        self.assertTrue(abs(got - nfd) <= 8 and got > 0, "open fds %r vs /proc %r" % (got, nfd))
        self.assertGreaterEqual(e.get("process_cpu_seconds_total"), 0)

    def test_values_move_across_worker_threads(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start(P, D, threads=4)
        before = self.scrape(px)
        n_threads, per = 8, 6  # 48 requests, each on its own connection
        results, errors = [], []
        lock = threading.Lock()

        def client(k):
            for j in range(per):
                try:
                    path, body = (("/v1/chat/completions", chat_body()) if (k + j) % 3 == 0
                                  else ("/v1/completions", completion_body()))
                    r = http_request(px.port, "POST", path, body)
                    with lock:
                        results.append((path, r.status))
                except Exception as ex:  # reported below
                    with lock:
                        errors.append(repr(ex))
        scrapes = {"n": 0, "err": None}
        done = threading.Event()

        def scraper():
            # Scrapes while requests flow: each one valid, none going backwards.
            prev = before
            for _ in range(500):
                if done.is_set():
                    break
                try:
                    prev = self.scrape(px, prev)
                    scrapes["n"] += 1
                except BaseException as ex:  # reported below
                    scrapes["err"] = ex
                    break
        ts = [threading.Thread(target=client, args=(k,)) for k in range(n_threads)]
        st = threading.Thread(target=scraper)
        st.start()
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        done.set()
        st.join(30)
        if scrapes["err"] is not None:
            raise scrapes["err"]
        self.assertGreater(scrapes["n"], 0)
        self.assertFalse(errors, errors)
        self.assertEqual(len(results), n_threads * per)
        self.assertTrue(all(s == 200 for _, s in results), results)
        n_chat = sum(1 for p, _ in results if p == "/v1/chat/completions")
        n_cmpl = len(results) - n_chat
        after = self.scrape(px, before)

        def delta(name, **lab):
            return self.val(after, name, **lab) - self.val(before, name, **lab)
        # Exact sums: 48 connections spread over 4 SO_REUSEPORT listeners, so
        # a count of one worker only would fall short.
        self.assertEqual(delta("pdproxy_requests_total", endpoint="/v1/completions", code="200"),
                         n_cmpl)
        self.assertEqual(delta("pdproxy_requests_total", endpoint="/v1/chat/completions",
                               code="200"), n_chat)
        for h in HIST:
            self.assertEqual(self.delta_all(before, after, h + "_count"), len(results), h)
            self.assertEqual(self.delta_all(before, after, h + "_bucket", le="+Inf"),
                             len(results), h)
            self.assertGreater(self.delta_all(before, after, h + "_sum"), 0, h)
        for role, m in (("prefill", P), ("decode", D)):
            self.assertEqual(delta("pdproxy_upstream_requests_total", role=role, backend=be(m),
                                   outcome="ok"), len(results), role)
            self.assertEqual(self.val(after, "pdproxy_backend_inflight", role=role,
                                      backend=be(m)), 0, role)
        self.assertEqual(len(P.requests), len(results))
        self.assertEqual(delta("pdproxy_kv_transfer_params_missing_total"), 0)
        self.assertEqual(delta("pdproxy_retries_total", role="prefill"), 0)
        # The process spent some CPU on all that.
        self.assertGreater(self.val(after, "process_cpu_seconds_total"), 0)

    def test_status_codes_counted(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        px = self.start(P, D, ["--api-key", "k1"])
        auth = {"Authorization": "Bearer k1"}
        e0 = self.scrape(px)
        sent = [
            ("POST", "/v1/completions", completion_body(), auth, 200),
            ("POST", "/v1/completions", completion_body(), {}, 401),
            ("POST", "/v1/chat/completions", chat_body(), {"Authorization": "Bearer no"}, 401),
            ("POST", "/v1/completions", "{not json", auth, 400),
            ("GET", "/v1/completions", None, auth, 405),
            ("GET", "/nowhere", None, {}, 404),
            ("GET", "/health", None, {}, 200),
            ("GET", "/healthcheck", None, {}, 200),
        ]
        for method, path, body, hs, want in sent:
            r = http_request(px.port, method, path, body, headers=hs)
            self.assertEqual(r.status, want, (method, path, r))
        e1 = self.scrape(px, e0)

        def d(ep, code):
            return (self.val(e1, "pdproxy_requests_total", endpoint=ep, code=code) -
                    self.val(e0, "pdproxy_requests_total", endpoint=ep, code=code))
        self.assertEqual(d("/v1/completions", "200"), 1)
        self.assertEqual(d("/v1/completions", "401"), 1)
        self.assertEqual(d("/v1/chat/completions", "401"), 1)
        self.assertEqual(d("/v1/completions", "400"), 1)
        self.assertEqual(d("/v1/completions", "405"), 1)
        self.assertEqual(d("/health", "200"), 1)
        self.assertEqual(d("/healthcheck", "200"), 1)
        codes404 = sum(v for lab, v in e1.samples("pdproxy_requests_total") if lab["code"] == "404")
        codes404 -= sum(v for lab, v in e0.samples("pdproxy_requests_total") if lab["code"] == "404")
        self.assertEqual(codes404, 1, "the 404 is counted once (under some endpoint label)")
        # Unknown paths must not become label values (unbounded cardinality).
        self.assertFalse([lab for lab, _ in e1.samples("pdproxy_requests_total")
                          if lab["endpoint"] == "/nowhere"])

    def test_histogram_buckets_reflect_durations(self):
        # P takes 0.3 s, D 0.3 s more: nothing may land in a bucket <= 0.25 s.
        P = self.mock(lambda r: Respond(200, [("Content-Type", "application/json")],
                                        prefill_handler()(r).body, delay=0.3), "P")
        D = self.mock(lambda r: Respond(200, [("Content-Type", "application/json")], b'{"x":1}',
                                        delay=0.3), "D")
        px = self.start(P, D, threads=2)
        before = self.scrape(px)
        r = http_request(px.port, "POST", "/v1/completions", completion_body())
        self.assertEqual(r.status, 200, r)
        after = self.scrape(px, before)
        for h, low in (("pdproxy_prefill_duration_seconds", 0.3),
                       ("pdproxy_time_to_first_byte_seconds", 0.6),
                       ("pdproxy_request_duration_seconds", 0.6)):
            d_small = self.delta_all(before, after, h + "_bucket", le="0.25")
            d_count = self.delta_all(before, after, h + "_count")
            d_sum = self.delta_all(before, after, h + "_sum")
            self.assertEqual(d_count, 1, h)
            self.assertEqual(d_small, 0, "%s: a >= %.1f s observation counted in le=0.25" % (h, low))
            self.assertGreaterEqual(d_sum, low - 0.02, h)
            self.assertLess(d_sum, low + 5, h)

    def test_ttfb_split_by_stream(self):
        """Time to first byte means time to first token only for streamed
        answers: the two kinds are told apart by a `stream` label, so a
        non-streamed request (its first byte is its whole answer) never
        lands among the streamed ones."""
        events = sse_events(["a", "bb"])

        def d(req):
            if req.json().get("stream"):
                return Stream(200, [("Content-Type", "text/event-stream")],
                              [(0, e) for e in events])
            return Respond(200, [("Content-Type", "application/json")], b'{"x":1}', delay=0.3)
        P = self.mock(prefill_handler(), "P")
        D = self.mock(d, "D")
        px = self.start(P, D, threads=2)
        h = "pdproxy_time_to_first_byte_seconds"
        e0 = self.scrape(px)
        for stream in (True, False, True):
            r = http_request(px.port, "POST", "/v1/completions", completion_body(stream=stream))
            self.assertEqual(r.status, 200, r)
        e1 = self.scrape(px, e0)
        labelsets = {frozenset(lab) for lab, _ in e1.samples(h + "_count")}
        self.assertEqual(labelsets, {frozenset({"stream"})}, "label sets of %s_count" % h)
        self.assertEqual(self.delta_all(e0, e1, h + "_count", stream="true"), 2)
        self.assertEqual(self.delta_all(e0, e1, h + "_count", stream="false"), 1)
        # The slow non-streamed answer (0.3 s) is not among the streamed ones.
        self.assertEqual(self.delta_all(e0, e1, h + "_bucket", stream="true", le="0.25"), 2)
        self.assertEqual(self.delta_all(e0, e1, h + "_bucket", stream="false", le="0.25"), 0)
        for lab, _ in e1.samples(h + "_bucket"):
            self.assertIn(lab["stream"], ("true", "false"), lab)

    def test_build_and_process_info(self):
        """pdproxy_build_info{version,commit} 1, process_start_time_seconds
        (Unix time), resident memory and open fds: what Prometheus's client
        libraries expose and dashboards expect."""
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        t_before = time.time()
        px = self.start(P, D, threads=1)
        e = self.scrape(px)
        self.assertEqual(e.families.get("pdproxy_build_info", {}).get("type"), "gauge",
                         "pdproxy_build_info family")
        infos = e.samples("pdproxy_build_info")
        self.assertEqual(len(infos), 1, infos)
        lab, v = infos[0]
        self.assertEqual(v, 1.0)
        self.assertEqual(set(lab), {"version", "commit"}, lab)
        out = run_pdproxy(["--version"]).stdout
        self.assertIn(lab["version"], out, "version label vs pdproxy --version")
        self.assertTrue(re.fullmatch(r"[0-9a-f]{7,40}|unknown", lab["commit"]), lab)
        self.assertEqual(e.families.get("process_start_time_seconds", {}).get("type"), "gauge")
        start = e.get("process_start_time_seconds")
        self.assertIsNotNone(start, "process_start_time_seconds")
        # Started after t_before (clock granularity of /proc: 1/100 s).
        self.assertTrue(t_before - 1 <= start <= time.time(), (t_before, start))
        self.assertGreater(e.get("process_resident_memory_bytes") or 0, 1 << 20)
        self.assertGreater(e.get("process_open_fds") or 0, 3)
        self.assertGreater(e.get("process_max_fds") or 0, 0)
        self.assertEqual(self.scrape(px, e).get("process_start_time_seconds"), start)

    def test_missing_params_counters(self):
        kv_no_rid = default_p_kv("x")
        del kv_no_rid["remote_request_id"]
        mode = {"m": "none"}

        def p(req):
            if mode["m"] == "none":
                return Respond(200, [("Content-Type", "application/json")],
                               b'{"id":"p","choices":[{"index":0,"text":"x"}]}')
            return prefill_handler(kv=kv_no_rid)(req)
        P = self.mock(p, "P")
        D = self.mock(decode_handler(), "D")
        px = self.start(P, D)
        e0 = self.scrape(px)
        for _ in range(3):
            self.assertEqual(http_request(px.port, "POST", "/v1/completions",
                                          completion_body()).status, 200)
        e1 = self.scrape(px, e0)
        self.assertEqual(self.val(e1, "pdproxy_kv_transfer_params_missing_total") -
                         self.val(e0, "pdproxy_kv_transfer_params_missing_total"), 3)
        self.assertEqual(self.val(e1, "pdproxy_remote_request_id_missing_total") -
                         self.val(e0, "pdproxy_remote_request_id_missing_total"), 0)
        mode["m"] = "norid"
        for _ in range(2):
            self.assertEqual(http_request(px.port, "POST", "/v1/chat/completions",
                                          chat_body()).status, 200)
        e2 = self.scrape(px, e1)
        self.assertEqual(self.val(e2, "pdproxy_remote_request_id_missing_total") -
                         self.val(e1, "pdproxy_remote_request_id_missing_total"), 2)
        self.assertEqual(self.val(e2, "pdproxy_kv_transfer_params_missing_total") -
                         self.val(e1, "pdproxy_kv_transfer_params_missing_total"), 0)

    def _leave(self, px, wait_pred, phase, backend_role=None, backend=None):
        """Send a request, wait for wait_pred(client), check in-flight gauges,
        leave, and check the phase's disconnect counter moves by one."""
        e0 = self.scrape(px)
        c = RawClient(px.port)
        c.request("POST", "/v1/completions", completion_body(stream=True))
        self.assertTrue(wait_pred(c), "request did not reach the expected phase")
        if backend_role:
            e = self.wait_metric(px, lambda e: e.get(
                "pdproxy_backend_inflight", role=backend_role, backend=be(backend)) == 1)
            self.assertEqual(e.get("pdproxy_backend_inflight", role=backend_role,
                                   backend=be(backend)), 1,
                             "inflight gauge of the hanging %s backend" % backend_role)
        c.close(rst=False)
        name = "pdproxy_client_disconnects_total"
        e1 = self.wait_metric(px, lambda e: self.val(e, name, phase=phase) >
                              self.val(e0, name, phase=phase))
        for ph in ("prefill", "decode", "stream"):
            self.assertEqual(self.val(e1, name, phase=ph) - self.val(e0, name, phase=ph),
                             1 if ph == phase else 0, "disconnects{phase=%s}" % ph)
        if backend_role:
            e2 = self.wait_metric(px, lambda e: e.get(
                "pdproxy_backend_inflight", role=backend_role, backend=be(backend)) == 0)
            self.assertEqual(e2.get("pdproxy_backend_inflight", role=backend_role,
                                    backend=be(backend)), 0, "inflight after the client left")
        return e0, e1

    def test_disconnects_and_inflight(self):
        pmode, dmode = {"m": "hang"}, {"m": "hang"}

        def p(req):
            return Hang(8.0) if pmode["m"] == "hang" else prefill_handler()(req)

        def d(req):
            if dmode["m"] == "hang":
                return Hang(8.0)
            return Stream(200, [("Content-Type", "text/event-stream")],
                          [(0, b"data: {\"a\":1}\n\n"), (8.0, b"data: [DONE]\n\n")])
        P = self.mock(p, "P")
        D = self.mock(d, "D")
        px = self.start(P, D, threads=4)
        # Prefill phase: P hangs.
        self._leave(px, lambda c: len(P.wait_requests(1, 5)) >= 1, "prefill", "prefill", P)
        # Decode phase: P answers, D hangs before any header.
        pmode["m"] = "ok"
        self._leave(px, lambda c: len(D.wait_requests(1, 5)) >= 1, "decode", "decode", D)
        # Stream phase: D sent its head and a first event, then stalls.
        dmode["m"] = "stream"

        def got_first_event(c):
            if len(D.wait_requests(2, 5)) < 2:
                return False
            r = c.read_response(timeout=5, until=lambda r: len(r.body) > 0)
            return r.status == 200 and r.stopped_early
        self._leave(px, got_first_event, "stream", "decode", D)

    def test_retries_and_outcomes(self):
        bad = self.mock(lambda r: Respond(500, [("Content-Type", "application/json")],
                                          b'{"error":"boom"}'), "Pbad")
        good = self.mock(prefill_handler(), "Pgood")
        D = self.mock(decode_handler(), "D")
        px = self.start_proxy([bad, good], [D], threads=2,
                              extra=["--drain-delay", "0", "--unhealthy-after", "100",
                                     "--health-interval", "0", "--prefill-retries", "2"])
        e0 = self.scrape(px)
        for _ in range(6):
            r = http_request(px.port, "POST", "/v1/completions", completion_body())
            self.assertEqual(r.status, 200, r)
        e1 = self.scrape(px, e0)
        nbad = len(bad.requests)
        self.assertGreaterEqual(nbad, 1, "round robin never chose the failing prefill")
        self.assertEqual(self.val(e1, "pdproxy_retries_total", role="prefill") -
                         self.val(e0, "pdproxy_retries_total", role="prefill"), nbad)
        self.assertEqual(self.val(e1, "pdproxy_retries_total", role="decode") -
                         self.val(e0, "pdproxy_retries_total", role="decode"), 0)
        bad_total = sum(v for lab, v in e1.samples("pdproxy_upstream_requests_total")
                        if lab["role"] == "prefill" and lab["backend"] == be(bad))
        bad_ok = self.val(e1, "pdproxy_upstream_requests_total", role="prefill",
                          backend=be(bad), outcome="ok")
        self.assertEqual(bad_total, nbad)
        self.assertEqual(bad_ok, 0, "a 500 counted as ok")
        self.assertEqual(self.val(e1, "pdproxy_upstream_requests_total", role="prefill",
                                  backend=be(good), outcome="ok"), 6)

    def test_decode_retries(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        dead = closed_port()
        px = self.start_proxy([P], [D, dead], threads=2,
                              extra=["--drain-delay", "0", "--health-interval", "0",
                                     "--unhealthy-after", "100"])
        e0 = self.scrape(px)
        for _ in range(4):
            r = http_request(px.port, "POST", "/v1/completions", completion_body())
            self.assertEqual(r.status, 200, r)
        e1 = self.scrape(px, e0)
        name = "127.0.0.1:%d" % dead
        dead_tries = sum(v for lab, v in e1.samples("pdproxy_upstream_requests_total")
                         if lab["role"] == "decode" and lab["backend"] == name)
        self.assertGreaterEqual(dead_tries, 1, "round robin never chose the dead decode")
        self.assertEqual(self.val(e1, "pdproxy_upstream_requests_total", role="decode",
                                  backend=name, outcome="ok"), 0)
        self.assertEqual(self.val(e1, "pdproxy_retries_total", role="decode") -
                         self.val(e0, "pdproxy_retries_total", role="decode"), dead_tries)
        self.assertEqual(self.val(e1, "pdproxy_upstream_requests_total", role="decode",
                                  backend=be(D), outcome="ok"), 4)

    def test_backend_up_after_ejection(self):
        P = self.mock(prefill_handler(), "P")
        D = self.mock(decode_handler(), "D")
        dead = closed_port()
        px = self.start_proxy([P, dead], [D], threads=2,
                              extra=["--drain-delay", "0", "--health-interval", "0.2",
                                     "--health-timeout", "0.5", "--unhealthy-after", "1"])
        name = "127.0.0.1:%d" % dead
        e = self.wait_metric(px, lambda e: e.get("pdproxy_backend_up", role="prefill",
                                                 backend=name) == 0, timeout=6)
        self.assertEqual(e.get("pdproxy_backend_up", role="prefill", backend=name), 0)
        self.assertEqual(e.get("pdproxy_backend_up", role="prefill", backend=be(P)), 1)
        self.assertEqual(e.get("pdproxy_backend_up", role="decode", backend=be(D)), 1)


if __name__ == "__main__":
    main()
