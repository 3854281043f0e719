#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A stand-in engine serving the OpenAI API (standard library HTTP) with the
driver (tests/plugin/driver.py) inside: PdkvConnector moves its KV blocks.
Speaks what pdproxy sends a vLLM P/D pair: prefill gets kv_transfer_params
{"do_remote_decode": true} (max_tokens 1) and answers with the connector's
kv_transfer_params at the top level; decode gets those back and streams.

Tokens are the prompt's UTF-8 bytes; each output token is a digest of the
prompt's KV in this engine's blocks, so the answer shows whether the blocks
arrived.  GET /metrics shows what vLLM's /metrics would of the connector
(vllm:pdkv_*).  Test routes: GET /test/state, /test/untouched; POST /test/pause
{"on": bool} (no block allocations: requests wait in the queue, as with a
full KV cache), /test/abort {"request_id": id}."""
import argparse
import json
import os
import queue
import secrets
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402


def tokens_of(body):
    if "messages" in body:
        text = "\n".join(str(m.get("content", "")) for m in body["messages"])
    else:
        text = body.get("prompt", "")
        if isinstance(text, list):
            text = "".join(map(str, text))
    return list(str(text).encode())


class Server:
    def __init__(self, a):
        geo = driver.Geometry(layers=a.layers, heads=a.heads, head_size=a.head_size,
                              block_size=a.block_size, num_blocks=a.num_blocks, mla=a.mla,
                              hnd=not a.nhd)
        extra = {"lease_ms": a.lease_ms, "fetch_wait_ms": 10000, "xfer_timeout_ms": 10000,
                 "connect_timeout_ms": 3000}
        if a.renew_s is not None:
            extra["lease_renew_s"] = a.renew_s
        self.engine = driver.Engine(a.engine_id, tp=a.tp, geo=geo, policy=a.policy,
                                    port=a.kv_port, extra=extra)
        self.engine.on_token = self.on_token
        self.waiters = {}
        self.mu = threading.Lock()
        self.stop = False
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self):
        try:
            while not self.stop:
                busy = self.engine.step()
                time.sleep(0.002 if busy else 0.005)  # the engine's step pace
        except BaseException:  # a broken engine must fail the test, not hang it
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(70)

    def on_token(self, req, tok, params):
        q = self.waiters.get(req.request_id)
        if q is not None:
            q.put((tok, params, req.status))

    def submit(self, rid, body):
        params = body.get("kv_transfer_params")
        req = Request(rid, tokens_of(body), int(body.get("max_tokens") or 16),
                      dict(params) if isinstance(params, dict) else None)
        q = queue.Queue()
        self.waiters[rid] = q
        self.engine.add(req)
        return q


def make_handler(srv, model):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def send_json(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def error(self, code, msg, typ="BadRequestError"):
            self.send_json(code, {"error": {"message": msg, "type": typ, "code": code}})

        def do_GET(self):
            if self.path == "/health":
                return self.send_json(200, {})
            if self.path == "/v1/models":
                return self.send_json(200, {"object": "list", "data": [
                    {"id": model, "object": "model", "owned_by": "pdkv-test"}]})
            if self.path == "/metrics":  # as vLLM's: the connector's vllm:pdkv_* families
                from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
                data = generate_latest(srv.engine.registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            if self.path == "/test/state":
                return self.send_json(200, srv.engine.state())
            if self.path == "/test/untouched":
                bad, n = srv.engine.untouched()
                return self.send_json(200, {"bad": bad, "never_allocated": n,
                                            "corrupt": srv.engine.corrupt})
            self.error(404, "no route " + self.path, "NotFoundError")

        def body(self):
            n = int(self.headers.get("Content-Length") or 0)
            try:
                return json.loads(self.rfile.read(n) or b"{}")
            except ValueError:
                return None

        def do_POST(self):
            body = self.body()
            if not isinstance(body, dict):
                return self.error(400, "body is not a JSON object")
            if self.path == "/test/pause":
                srv.engine.pause_alloc = bool(body.get("on"))
                return self.send_json(200, {})
            if self.path == "/test/abort":
                return self.send_json(200, {"aborted": srv.engine.abort(body.get("request_id"))})
            chat = self.path == "/v1/chat/completions"
            if not chat and self.path != "/v1/completions":
                return self.error(404, "no route " + self.path, "NotFoundError")
            xid = self.headers.get("X-Request-Id") or secrets.token_hex(8)
            rid = "%s-%s-0-%s" % ("chatcmpl" if chat else "cmpl", xid, secrets.token_hex(4))
            q = srv.submit(rid, body)
            try:
                if body.get("stream"):
                    self.stream(q, rid, chat, body)
                else:
                    self.whole(q, rid, chat, body)
            finally:
                srv.waiters.pop(rid, None)

        def collect(self, q):
            tok, params, status = q.get(timeout=60)
            return tok, params, status

        def whole(self, q, rid, chat, body):
            toks = []
            while True:
                tok, params, status = self.collect(q)
                if tok is None:
                    break
                toks.append(tok)
            if status == RequestStatus.FINISHED_ERROR:
                return self.error(500, "KV cache load failed for " + rid, "InternalServerError")
            text = "".join(" t%d" % t for t in toks)
            usage = {"prompt_tokens": len(tokens_of(body)), "completion_tokens": len(toks)}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "finish_reason": "length"})
            self.send_json(200, {"id": rid, "object": "chat.completion" if chat else
                                 "text_completion", "created": int(time.time()),
                                 "model": model, "choices": [choice], "usage": usage,
                                 "kv_transfer_params": params})

        def stream(self, q, rid, chat, body):
            tok, params, status = self.collect(q)
            if tok is None and status == RequestStatus.FINISHED_ERROR:
                return self.error(500, "KV cache load failed for " + rid, "InternalServerError")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(obj):
                data = ("data: %s\n\n" % (obj if isinstance(obj, str) else json.dumps(obj))).encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            try:
                while tok is not None:
                    if chat:
                        c = {"index": 0, "delta": {"content": " t%d" % tok}, "finish_reason": None}
                    else:
                        c = {"index": 0, "text": " t%d" % tok, "finish_reason": None}
                    chunk({"id": rid, "object": "chat.completion.chunk" if chat else
                           "text_completion", "model": model, "choices": [c]})
                    tok, params, status = self.collect(q)
                fin = {"index": 0, "finish_reason": "length"}
                fin.update({"delta": {}} if chat else {"text": ""})
                chunk({"id": rid, "object": "chat.completion.chunk" if chat else
                       "text_completion", "model": model, "choices": [fin]})
                chunk("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                srv.engine.abort(rid)
    return H


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--kv-port", type=int, required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--mla", action="store_true")
    ap.add_argument("--nhd", action="store_true")
    ap.add_argument("--policy", default="fail", choices=["fail", "recompute"])
    ap.add_argument("--lease-ms", type=int, default=30000)
    ap.add_argument("--renew-s", type=float, default=None)
    ap.add_argument("--model", default="pdkv-test")
    a = ap.parse_args()
    srv = Server(a)
    ThreadingHTTPServer.request_queue_size = 256
    httpd = ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(srv, a.model))
    httpd.daemon_threads = True
    print("ready", flush=True)
    try:
        httpd.serve_forever()
    finally:
        srv.stop = True
        srv.engine.shutdown()


if __name__ == "__main__":
    main()
