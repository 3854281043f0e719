#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The vLLM plugin on GPU memory (tests/gpu/run_gpu_tests.sh runs it when
torch has CUDA): prefill and decode engines of the driver with their KV
caches on the GPU (FlashAttention HND, several layers; MLA; TP 1->2), every
loaded block byte-exact, untouched blocks untouched, no blocks left held on
either side.  Prints one RESULT line; exit 0 only if every case went as it
must, 77 without CUDA (unless --device cpu, the script's own check on a
machine without a GPU).

--path says how the connector moves CUDA KV on this machine, as
run_gpu_tests.sh found it: direct (UCX has CUDA transports: every case must
load) or staged (through the pinned pool).  TP 1->2 reads half of each
block, which staged regions refuse by design (docs/ARCHITECTURE.md, "Staged
CUDA regions do not support slices"): there that case must end in that
refusal -- every request FINISHED_ERROR with its load failing on
KVC_ERR_UNSUPPORTED, nothing corrupt, no blocks stranded -- and a load that
succeeds fails the check.  On a GPU the connector's own counters must agree
with --path."""
import argparse
import logging
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

harness.need_torch()
import torch  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--path", choices=("direct", "staged"), default="direct",
                help="the connector's path for CUDA memory here (run_gpu_tests.sh decides)")
a = ap.parse_args()
if a.device == "cuda" and not torch.cuda.is_available():
    print("RESULT plugin skipped: torch has no CUDA")
    sys.exit(77)

import driver  # noqa: E402
from test_plugin_layouts import Local  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402


class Records(logging.Handler):
    """The plugin's warnings and errors, kept (and echoed to stderr)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        line = record.getMessage()
        self.lines.append(line)
        print(line, file=sys.stderr)


log = Records()
logging.getLogger("pdkv").addHandler(log)

# (name, prefill TP, decode TP, geometry, refused on this path)
cases = [("hnd", 1, 1, {}, False), ("mla", 1, 1, {"mla": True, "head_size": 64}, False),
         ("tp1to2", 1, 2, {}, a.path == "staged")]
SETTLE_S = 15  # a refused load's prefill blocks wait for their lease (LEASE_MS)
LEASE_MS = 2000


def settled(e):
    s = e.state()
    return (s["free_blocks"] == s["num_blocks"] and not s["waiting"] and not s["running"]
            and not s["delayed"] and not s["loading"] and not s["pending_fetches"]
            and not s["published_now"])


def wait_settled(e):
    return bool(harness.wait_until(lambda: settled(e), SETTLE_S, 0.05))


def cuda_regions(e):
    """(direct, staged): the CUDA regions of the engine's agents."""
    return tuple(sum(rk.conn.worker.agent.stat(k) for rk in e.ranks)
                 for k in ("cuda_direct_regions", "cuda_staged_regions"))


failed = []
t0 = time.monotonic()
refusals = 0
for name, ptp, dtp, geo, refused in cases:
    g = dict(layers=4, heads=8, head_size=128, num_blocks=256, device=a.device)
    g.update(geo)
    extra = {"lease_ms": LEASE_MS} if refused else None
    p = Local("P", ptp, driver.Geometry(**g), extra=extra)
    d = Local("D", dtp, driver.Geometry(**g), extra=extra)
    try:
        if a.device != "cpu":
            for who, e in (("prefill", p.e), ("decode", d.e)):
                direct, staged = cuda_regions(e)
                if (staged if a.path == "direct" else direct) or not (direct or staged):
                    failed.append("%s: %s's CUDA regions are %d direct, %d staged: not the %s "
                                  "path run_gpu_tests.sh named" % (name, who, direct, staged,
                                                                   a.path))
        want = RequestStatus.FINISHED_ERROR if refused else RequestStatus.FINISHED_LENGTH_CAPPED
        for i, n in enumerate((16, 300, 1000)):
            prompt = list(range(i, i + n))
            _, kv, st = p.run("p%d" % i, prompt, 1, {"do_remote_decode": True})
            if st != RequestStatus.FINISHED_LENGTH_CAPPED:
                failed.append("%s: prefill of request %d %s" % (name, i, st.name))
            _, _, st = d.run("d%d" % i, prompt, 2, dict(kv))
            if st != want:
                failed.append("%s: request %d %s, expected %s%s" % (
                    name, i, st.name, want.name,
                    " (the staged path's refusal, KVC_ERR_UNSUPPORTED)" if refused else ""))
        s = d.e.state()
        bad, _ = d.e.untouched()
        if refused:
            for i in range(3):
                why = [m for m in log.lines if re.search(r"load of d%d\b" % i, m)]
                if not why or any("KVC_ERR_UNSUPPORTED" not in m for m in why):
                    failed.append("%s: request %d's load did not fail on KVC_ERR_UNSUPPORTED "
                                  "alone: %s" % (name, i, why[:2]))
            if (s["load_failed"], s["verified"], s["loaded"], s["corrupt"]) != (3, 0, 0, 0) or bad:
                failed.append("%s: %s %s %s" % (name, s, d.e.corrupt[:2], bad[:2]))
            else:
                refusals += 3
        elif s["verified"] != 3 or s["corrupt"] or bad:
            failed.append("%s: %s %s %s" % (name, s, d.e.corrupt[:2], bad[:2]))
        for who, e in (("prefill", p.e), ("decode", d.e)):
            if not wait_settled(e):
                failed.append("%s: %s holds blocks %.0f s later: %s" % (name, who, SETTLE_S,
                                                                        e.state()))
    finally:
        p.close()
        d.close()
print("RESULT plugin path=%s cases=%d failed=%d refused_as_documented=%d seconds=%.1f %s"
      % (a.path, len(cases), len(failed), refusals, time.monotonic() - t0, "; ".join(failed)))
sys.exit(1 if failed else 0)
