#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The vLLM plugin on GPU memory (tests/gpu/run_gpu_tests.sh runs it when
torch has CUDA): prefill and decode engines of the driver with their KV
caches on the GPU (FlashAttention HND, several layers; MLA; TP 1->2), every
loaded block byte-exact, untouched blocks untouched.  Prints one RESULT line;
exit 0 only if every case passed, 77 without CUDA (unless --device cpu, the
script's own check on a machine without a GPU)."""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
a = ap.parse_args()
if a.device == "cuda" and not torch.cuda.is_available():
    print("RESULT plugin skipped: torch has no CUDA")
    sys.exit(77)

import driver  # noqa: E402
from test_plugin_layouts import Local  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

cases = [("hnd", 1, 1, {}), ("mla", 1, 1, {"mla": True, "head_size": 64}), ("tp1to2", 1, 2, {})]
failed = []
t0 = time.monotonic()
for name, ptp, dtp, geo in cases:
    g = dict(layers=4, heads=8, head_size=128, num_blocks=256, device=a.device)
    g.update(geo)
    p = Local("P", ptp, driver.Geometry(**g))
    d = Local("D", dtp, driver.Geometry(**g))
    try:
        for i, n in enumerate((16, 300, 1000)):
            prompt = list(range(i, i + n))
            _, kv, st = p.run("p%d" % i, prompt, 1, {"do_remote_decode": True})
            _, _, st = d.run("d%d" % i, prompt, 2, dict(kv))
            if st != RequestStatus.FINISHED_LENGTH_CAPPED:
                failed.append("%s: request %d %s" % (name, i, st.name))
        s = d.e.state()
        bad, _ = d.e.untouched()
        if s["verified"] != 3 or s["corrupt"] or bad:
            failed.append("%s: %s %s %s" % (name, s, d.e.corrupt[:2], bad[:2]))
    finally:
        p.close()
        d.close()
print("RESULT plugin cases=%d failed=%d seconds=%.1f %s" % (len(cases), len(failed),
      time.monotonic() - t0, "; ".join(failed)))
sys.exit(1 if failed else 0)
