#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The whole flow: pdproxy in front of two engine processes serving the
OpenAI API with PdkvConnector inside.  A streamed chat request goes through
prefill (max_tokens 1, kv_transfer_params do_remote_decode) and decode, its
KV moved by the plugin: decode verified the blocks byte-exact, prefill got
its blocks back, the stream carries max_tokens chunks and [DONE]."""
import http.client
import json
import os
import subprocess
import unittest

import harness
from harness import Engine

harness.need_torch()
PDPROXY = os.path.join(os.environ.get("PX_BIN_DIR", os.path.join(harness.BUILD, "bin")), "pdproxy")
if not os.access(PDPROXY, os.X_OK):
    PDPROXY = os.path.join(harness.BUILD, "proxy", "pdproxy")


class Proxy(unittest.TestCase):
    def setUp(self):
        self.p = Engine("P")
        self.addCleanup(self.p.stop)
        self.d = Engine("D")
        self.addCleanup(self.d.stop)
        self.port = harness.free_ports(1)
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                     "pdkv-pdproxy-%d.log" % self.port), "w+")
        self.addCleanup(self.log.close)
        self.px = subprocess.Popen(
            [PDPROXY, "--port", str(self.port), "--threads", "2", "--drain-delay", "0",
             "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(self.p.port),
             "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(self.d.port)],
            stdout=self.log, stderr=self.log)
        self.addCleanup(self.stop_proxy)
        def ready():
            self.assertIsNone(self.px.poll(), "pdproxy exited")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/healthcheck")
                ok = c.getresponse().status == 200
                c.close()
                return ok
            except OSError:
                return False
        self.assertTrue(harness.wait_until(ready, 15, 0.1), "pdproxy not ready")

    def stop_proxy(self):
        self.px.terminate()
        try:
            self.px.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.px.kill()
            self.px.wait()

    def test_streamed_chat_through_pdproxy(self):
        body = {"model": "pdkv-test", "stream": True, "max_tokens": 5,
                "messages": [{"role": "user", "content": "tell me about " + "disaggregation " * 9}]}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request("POST", "/v1/chat/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read().decode()
        c.close()
        self.assertEqual(r.status, 200, raw)
        self.assertIn("text/event-stream", r.getheader("Content-Type"))
        events = [ln[6:] for ln in raw.split("\n") if ln.startswith("data: ")]
        self.assertEqual(events[-1], "[DONE]")
        content = [json.loads(e)["choices"][0].get("delta", {}).get("content")
                   for e in events[:-1]]
        self.assertEqual(len([x for x in content if x]), 5, raw)
        ds = self.d.wait_state(lambda s: s["verified"] == 1)
        self.assertEqual((ds["loaded"], ds["verified"], ds["corrupt"], ds["load_failed"]),
                         (1, 1, 0, 0), ds)
        ps = self.p.wait_state(lambda s: s["published_now"] == 0 and
                               s["free_blocks"] == s["num_blocks"])
        self.assertEqual((ps["published_now"], ps["free_blocks"]), (0, ps["num_blocks"]), ps)


if __name__ == "__main__":
    unittest.main(verbosity=2)
