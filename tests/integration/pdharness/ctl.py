# SPDX-License-Identifier: Apache-2.0
"""The control-plane tests' helpers: config files, admin calls, polling
/ready for a generation."""

import json
import os
import signal
import tempfile

from pdharness.client import http_request
from pdharness.net import HOST, wait_value


def url(m):
    return "http://%s:%d" % (HOST, m.port)


def write_yaml(path, text):
    """Replaces the file at once (rename), as a ConfigMap update does."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def pools_yaml(pools, extra=""):
    """pools: [(name, models, [prefill mocks/urls], [decode mocks/urls])]."""
    def u(x):
        return x if isinstance(x, str) else url(x)
    out = [extra.rstrip("\n")] if extra else []
    out.append("pools:")
    for name, models, p, d in pools:
        out.append("  - name: %s" % json.dumps(name))
        out.append("    models: %s" % json.dumps(list(models)))
        out.append("    prefill: %s" % json.dumps([u(x) for x in p]))
        out.append("    decode: %s" % json.dumps([u(x) for x in d]))
    return "\n".join(out) + "\n"


def tmpdir(case):
    d = tempfile.mkdtemp(prefix="pdproxy-ctl-")
    case.addCleanup(lambda: [os.unlink(os.path.join(d, f)) for f in os.listdir(d)] and None
                    or os.rmdir(d))
    return d


def ready(px):
    r = http_request(px.port, "GET", "/ready")
    return r.status, json.loads(bytes(r.body))


def wait_generation(case, px, gen, timeout=10.0):
    doc = wait_value(lambda: ready(px)[1], lambda d: d.get("generation") == gen, timeout)
    if doc.get("generation") == gen:
        return doc
    case.fail("generation stayed %r, wanted %r; stderr:\n%s"
              % (doc.get("generation"), gen, px.stderr()[-3000:]))


def sighup(px):
    os.kill(px.proc.pid, signal.SIGHUP)


def admin(port, method, path, body=None, token=None):
    hs = {}
    if token is not None:
        hs["Authorization"] = "Bearer " + token
    r = http_request(port, method, path, body, headers=hs)
    try:
        doc = json.loads(bytes(r.body)) if r.body else None
    except ValueError:
        doc = None
    return r.status, doc


def token_file(case, d, token="admin-token-0123456789abcdef"):
    path = os.path.join(d, "admin.token")
    with open(path, "w") as f:
        f.write(token + "\n")
    return path, token

