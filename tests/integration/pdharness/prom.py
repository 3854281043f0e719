# SPDX-License-Identifier: Apache-2.0
"""Prometheus text pages (pdproxy's /metrics, engine-sim's): one parser.

* ``parse_prom(text)``: [(name, {label: value}, float)] for every sample.
* ``prom(port)``: GET /metrics on 127.0.0.1:port, parsed.
* ``metric(samples, name, **labels)``: the sum of the matching samples.
* ``prom_values(port)``: {name: value} with labels dropped (the last sample
  of a name wins), for pages with one sample a name."""

import re

from pdharness.client import http_request

_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prom(text):
    """[(name, {label: value}, float)] for every sample line."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels_txt, value = rest.rsplit("}", 1)
            labels = {k: v for k, v in _LABEL_RE.findall(labels_txt)}
        else:
            name, value = line.split(None, 1)
            labels = {}
        out.append((name, labels, float(value.split()[0])))
    return out


def prom(port, path="/metrics"):
    r = http_request(port, "GET", path)
    if r.status != 200:
        raise AssertionError("GET %s on %d answered %s: %r" % (path, port, r.status, r.body[:200]))
    return parse_prom(r.body.decode("utf-8", "replace"))


def metric(samples, name, **labels):
    """Sum of the samples called `name` whose labels include `labels`
    (None when there is none)."""
    vals = [v for n, l, v in samples
            if n == name and all(l.get(k) == str(x) for k, x in labels.items())]
    return sum(vals) if vals else None


def prom_values(port, path="/metrics"):
    """{name: value} of the page on `port`, labels dropped."""
    return {name: value for name, _, value in prom(port, path)}
