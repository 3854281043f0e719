# SPDX-License-Identifier: Apache-2.0
"""A Kubernetes API server for EndpointSlices (discovery.k8s.io/v1), as
much of it as a list + watch client sees: HTTPS with a bearer token, list
with labelSelector, limit and continue, a resourceVersion per change, watch
from a resourceVersion with chunked JSON lines (ADDED, MODIFIED, DELETED,
BOOKMARK), the ERROR event with a 410 Status when the version is older than
the compacted history, timeoutSeconds, and hooks to drop every watch, compact
the history or rotate the token.  Python stdlib only; 127.0.0.1.

    api = K8sApi(tmpdir); api.start()
    api.put_slice("ns", "prefill-a", {"kubernetes.io/service-name": "prefill"},
                  [("http", 8100)], [ep("127.0.0.1")])
    api.delete_slice("ns", "prefill-a")
"""
import json
import os
import ssl
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdharness.net import HOST


def ep(ip, ready=True, serving=None, terminating=False):
    """An endpoint of a slice."""
    conds = {"ready": ready, "serving": ready if serving is None else serving,
             "terminating": terminating}
    return {"addresses": [ip], "conditions": conds}


def make_cert(d):
    """A self-signed certificate for 127.0.0.1 (its own CA)."""
    key, crt = os.path.join(d, "api.key"), os.path.join(d, "api.crt")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", crt, "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return crt, key


class K8sApi:
    def __init__(self, d, token="k8s-token-0123456789"):
        self.dir = d
        self.token = token
        self.lock = threading.Condition()
        self.rv = 100
        self.slices = {}      # (ns, name) -> object
        self.events = []      # (rv, ns, type, object)
        self.compacted = 0    # versions <= this are gone (410)
        self.generation = 0   # bumped by drop_watches()
        self.lists = 0
        self.watches = []     # resourceVersion of each watch request
        self.unauthorized = 0
        self.bookmark_s = 1.0
        self.crt, self.key = make_cert(d)
        self.server = None

    # ---- state ----------------------------------------------------------
    def _obj(self, ns, name, labels, ports, endpoints):
        return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": name, "namespace": ns, "labels": dict(labels),
                             "resourceVersion": str(self.rv)},
                "addressType": "IPv4",
                "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
                "endpoints": list(endpoints)}

    def put_slice(self, ns, name, labels, ports, endpoints):
        with self.lock:
            self.rv += 1
            kind = "MODIFIED" if (ns, name) in self.slices else "ADDED"
            o = self._obj(ns, name, labels, ports, endpoints)
            self.slices[(ns, name)] = o
            self.events.append((self.rv, ns, kind, o))
            self.lock.notify_all()
            return self.rv

    def delete_slice(self, ns, name):
        with self.lock:
            o = self.slices.pop((ns, name))
            self.rv += 1
            o = json.loads(json.dumps(o))
            o["metadata"]["resourceVersion"] = str(self.rv)
            self.events.append((self.rv, ns, "DELETED", o))
            self.lock.notify_all()

    def compact(self):
        """Forgets the history: a watch from an older version gets 410."""
        with self.lock:
            self.compacted = self.rv
            self.events = []

    def drop_watches(self):
        """Every watch in progress is cut off (its connection closed)."""
        with self.lock:
            self.generation += 1
            self.lock.notify_all()

    def set_token(self, token):
        with self.lock:
            self.token = token

    # ---- HTTP -----------------------------------------------------------
    def start(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def reply(self, code, doc):
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def status(self, code, reason, msg):
                self.reply(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "message": msg, "reason": reason, "code": code})

            def do_GET(self):
                u = urllib.parse.urlsplit(self.path)
                q = dict(urllib.parse.parse_qsl(u.query))
                parts = u.path.split("/")
                if (len(parts) != 7 or parts[1:4] != ["apis", "discovery.k8s.io", "v1"]
                        or parts[4] != "namespaces" or parts[6] != "endpointslices"):
                    return self.status(404, "NotFound", "no such path")
                with api.lock:
                    tok = api.token
                if self.headers.get("Authorization") != "Bearer " + tok:
                    with api.lock:
                        api.unauthorized += 1
                    return self.status(401, "Unauthorized", "Unauthorized")
                ns = parts[5]
                sel = {}
                for term in filter(None, q.get("labelSelector", "").split(",")):
                    k, _, v = term.partition("=")
                    sel[k] = v

                def match(o):
                    labels = o["metadata"].get("labels") or {}
                    return all(labels.get(k) == v for k, v in sel.items())
                if q.get("watch") in ("1", "true"):
                    return self.watch(ns, match, q)
                with api.lock:
                    api.lists += 1
                    items = [o for (n, _), o in sorted(api.slices.items()) if n == ns and match(o)]
                    rv = api.rv
                start = 0
                if q.get("continue"):
                    start, _, rv = q["continue"].partition(":")
                    start = int(start)
                limit = int(q.get("limit") or 0) or len(items) or 1
                page = items[start:start + limit]
                md = {"resourceVersion": str(rv)}
                if start + limit < len(items):
                    md["continue"] = "%d:%s" % (start + limit, rv)
                self.reply(200, {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                 "metadata": md, "items": page})

            def chunk(self, doc):
                data = (json.dumps(doc) + "\n").encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def watch(self, ns, match, q):
                rv = int(q.get("resourceVersion") or 0)
                timeout = float(q.get("timeoutSeconds") or 300)
                bookmarks = q.get("allowWatchBookmarks") == "true"
                with api.lock:
                    api.watches.append(rv)
                    gen = api.generation
                    gone = rv < api.compacted
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if gone:
                    self.chunk({"type": "ERROR", "object": {
                        "kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "message": "too old resource version: %d (%d)" % (rv, api.compacted),
                        "reason": "Expired", "code": 410}})
                    self.wfile.write(b"0\r\n\r\n")
                    return
                end = time.monotonic() + timeout
                next_bm = time.monotonic() + api.bookmark_s
                sent = rv
                try:
                    while True:
                        with api.lock:
                            out = [(r, t, o) for r, n, t, o in api.events
                                   if r > sent and n == ns and match(o)]
                            if api.events:
                                sent = max(sent, api.events[-1][0])
                            cur = api.rv
                            if not out:
                                wait = min(end, next_bm) - time.monotonic()
                                if wait > 0 and api.generation == gen:
                                    api.lock.wait(wait)
                            dropped = api.generation != gen
                        if dropped:
                            # cut off: no terminating chunk, the socket closes
                            self.close_connection = True
                            self.connection.shutdown(2)
                            return
                        for r, t, o in out:
                            self.chunk({"type": t, "object": o})
                        now = time.monotonic()
                        if now >= end:
                            break
                        if bookmarks and now >= next_bm:
                            self.chunk({"type": "BOOKMARK", "object": {
                                "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                "metadata": {"resourceVersion": str(cur)}}})
                            next_bm = now + api.bookmark_s
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError, OSError):
                    self.close_connection = True

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.server.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.crt, self.key)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.url = "https://%s:%d" % (HOST, self.port)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self):
        if self.server:
            self.drop_watches()
            self.server.shutdown()
            self.server.server_close()
