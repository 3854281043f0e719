# SPDX-License-Identifier: Apache-2.0
"""A real client nobody here wrote: the official OpenAI SDK for Node sends a
completion and a streamed chat completion through pdproxy to engine-sims.
Skips (exit 77) only when npm cannot install the package from its registry."""
import json
import os
import shutil
import subprocess
import sys
import unittest

from pdharness.client import answer_text, post_json
from pdharness.cluster import ClusterCase
from pdharness.procs import start_engine_sim, start_sim_proxy
from pdharness.prom import prom_values

HERE = os.path.dirname(os.path.abspath(__file__))
SDK_DIR = os.path.join(os.environ.get("PX_BUILD_DIR", "/tmp"), "npm-openai")


def install_sdk():
    """Returns None when the SDK is ready, else npm's words."""
    if os.path.exists(os.path.join(SDK_DIR, "node_modules", "openai", "package.json")):
        return None
    if not shutil.which("npm") or not shutil.which("node"):
        return "node/npm not installed"
    os.makedirs(SDK_DIR, exist_ok=True)
    with open(os.path.join(SDK_DIR, "package.json"), "w") as f:
        f.write('{"name":"pdproxy-sdk-check","private":true}\n')
    try:
        p = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent", "openai"],
                           cwd=SDK_DIR, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return "npm install timed out"
    if p.returncode != 0:
        return "npm install failed: " + (p.stderr or p.stdout)[-500:]
    return None


class OpenAISDKTest(ClusterCase):
    def test_official_node_sdk_through_pdproxy(self):
        p = self.start(start_engine_sim("prefill"))
        d = self.start(start_engine_sim("decode", ["--itl-ms", "2"]))
        ref = self.start(start_engine_sim("both"))
        px = self.start(start_sim_proxy([p.port], [d.port]))
        out = subprocess.run(["node", os.path.join(HERE, "openai_client.mjs"),
                              os.path.join(SDK_DIR, "node_modules", "openai"),
                              "http://127.0.0.1:%d/v1" % px.port, "sim-model"],
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        _, _, raw = post_json(ref.port, "/v1/completions", {
            "model": "sim-model", "max_tokens": 12,
            "prompt": "The official SDK asks for a completion through the proxy"})
        self.assertEqual(got["completion"], answer_text("/v1/completions", raw, False))
        _, _, raw = post_json(ref.port, "/v1/chat/completions", {
            "model": "sim-model", "max_tokens": 10,
            "messages": [{"role": "user",
                          "content": "Stream me a chat answer through pdproxy, please."}]})
        self.assertEqual(got["chat"], answer_text("/v1/chat/completions", raw, False))
        self.assertEqual(got["usage"]["completion_tokens"], 10)
        self.assertEqual(prom_values(d.port)["engine_sim_kv_fetches_total"], 2)


if __name__ == "__main__":
    why = install_sdk()
    if why:
        print("SKIP: the OpenAI SDK for Node could not be installed (%s)" % why)
        sys.exit(77)
    unittest.main(verbosity=2)
