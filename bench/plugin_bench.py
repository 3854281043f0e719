#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What the vLLM plugin (connector/python, pdkv) costs on top of
libkvconnector.  Two agents in this process (prefill, decode), torch CPU
tensors as KV caches, UCX as $UCX_TLS says (default tcp).

  direct  pdkv.lib: kvc_publish, kvc_fetch, wait for FETCH_DONE (ctypes only)
  plugin  PdkvConnector's scheduler and worker halves called as vLLM calls
          them (request_finished, build_connector_meta, start_load_kv on
          prefill; get_num_new_matched_tokens, update_state_after_alloc,
          build_connector_meta, start_load_kv, get_finished on decode)

Prints, per prompt size, the median time per request of both, the
difference (the plugin's added latency) and GB/s.  Run:
  PDKV_LIBRARY=build/connector/libkvconnector.so /usr/bin/python3 bench/plugin_bench.py
"""
import argparse
import json
import os
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "plugin", "standins"))
sys.path.insert(0, os.path.join(ROOT, "connector", "python"))
os.environ.setdefault("PDKV_LIBRARY", os.path.join(ROOT, "build", "connector", "libkvconnector.so"))
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("KVC_SECRET", "bench")
os.environ.setdefault("KVC_LOG_LEVEL", "error")

import torch  # noqa: E402

from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from pdkv import lib as kvc  # noqa: E402
from pdkv.connector import PdkvConnector  # noqa: E402


def caches(layers, blocks, bs, heads, hd):
    return {f"l{i}": torch.randn(2, blocks, heads, bs, hd, dtype=torch.float16)
            .permute(0, 1, 3, 2, 4) for i in range(layers)}


def cfg(name, port, a):
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(engine_id=name, kv_connector_extra_config={
            "side_channel_host": "127.0.0.1", "side_channel_port": port}),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
        cache_config=types.SimpleNamespace(block_size=a.block_size),
        model_config=types.SimpleNamespace(use_mla=False))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 1024, 4096])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--port", type=int, default=23600)
    a = ap.parse_args()
    nb = max(a.tokens) // a.block_size * 2 + 8
    parallel_state.set_rank(0)
    P = {r: PdkvConnector(cfg("P", a.port, a), r, None) for r in KVConnectorRole}
    D = {r: PdkvConnector(cfg("D", a.port + 10, a), r, None) for r in KVConnectorRole}
    pc, dc = caches(a.layers, nb, a.block_size, a.heads, a.head_size), \
        caches(a.layers, nb, a.block_size, a.heads, a.head_size)
    P[KVConnectorRole.WORKER].register_kv_caches(pc)
    D[KVConnectorRole.WORKER].register_kv_caches(dc)
    pa = P[KVConnectorRole.WORKER].worker.agent
    da = D[KVConnectorRole.WORKER].worker.agent
    # direct agents over the same memory, own ports, own event queues
    regs = lambda cs: [(p.data_ptr(), p.shape[0] * p.stride(0) * p.element_size())  # noqa: E731
                       for t in cs.values() for p in (t[0], t[1])]
    xa = kvc.Agent("XP", listen_port=a.port + 20)
    xb = kvc.Agent("XD", listen_port=a.port + 21)
    xa.register_regions(nb, regs(pc))
    xb.register_regions(nb, regs(dc))
    evs = []
    xa.start(evs.append)
    xb.start(evs.append)
    block_bytes = 2 * a.layers * a.block_size * a.heads * a.head_size * 2
    print("model: %d layers x K,V, %d heads x %d, block %d tokens: %.0f KiB per block (all regions); "
          "UCX_TLS=%s; library %s" % (a.layers, a.heads, a.head_size, a.block_size,
                                      block_bytes / 1024, os.environ["UCX_TLS"], kvc.library_path()))
    print("%8s %7s %12s %12s %12s %9s %9s" % ("tokens", "blocks", "direct_us", "plugin_us",
                                             "added_us", "direct", "plugin"))
    seq = 0
    for tokens in a.tokens:
        n = -(-tokens // a.block_size)
        src, dst = list(range(n)), list(range(n, 2 * n))
        tdir, tplug = [], []
        for _ in range(a.reps):
            seq += 1
            # direct
            evs.clear()
            t0 = time.perf_counter()
            kv = json.loads(xa.publish("x%d" % seq, src, token=kvc.new_token()))
            xb.fetch(kv, dst)
            while not any(e.type == kvc.EventType.FETCH_DONE for e in evs):
                if any(e.type == kvc.EventType.FETCH_FAILED for e in evs):
                    raise SystemExit("direct fetch failed: %s" % evs)
                time.sleep(0)
            tdir.append(time.perf_counter() - t0)
            # plugin: prefill finishes, publishes; decode loads
            rid = "p%d" % seq
            t0 = time.perf_counter()
            req = Request(rid, [1] * tokens, 1, {"do_remote_decode": True})
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            _, params = P[KVConnectorRole.SCHEDULER].request_finished(req, src)
            meta = P[KVConnectorRole.SCHEDULER].build_connector_meta(None)
            pw = P[KVConnectorRole.WORKER]
            pw.bind_connector_metadata(meta)
            pw.start_load_kv(None)
            pw.clear_connector_metadata()
            dreq = Request("d%d" % seq, [1] * tokens, 4, dict(params))
            ds, dw = D[KVConnectorRole.SCHEDULER], D[KVConnectorRole.WORKER]
            ext, _ = ds.get_num_new_matched_tokens(dreq, 0)
            ds.update_state_after_alloc(dreq, KVCacheBlocks(dst), ext)
            dw.bind_connector_metadata(ds.build_connector_meta(None))
            dw.start_load_kv(None)
            dw.clear_connector_metadata()
            while True:
                _, recv = dw.get_finished(set())
                if recv:
                    break
                time.sleep(0)
            tplug.append(time.perf_counter() - t0)
            if dw.get_block_ids_with_load_errors():
                raise SystemExit("plugin load failed")
            # prefill's blocks come back (not timed)
            deadline = time.monotonic() + 10
            while not pw.get_finished({rid})[0] and time.monotonic() < deadline:
                time.sleep(0.001)
        md, mp = statistics.median(tdir), statistics.median(tplug)
        gb = n * block_bytes / 1e9
        print("%8d %7d %12.0f %12.0f %12.0f %7.2fGB/s %7.2fGB/s" % (
            tokens, n, md * 1e6, mp * 1e6, (mp - md) * 1e6, gb / md, gb / mp))
    for c in (P, D):
        c[KVConnectorRole.WORKER].shutdown()
    xa.close()
    xb.close()


if __name__ == "__main__":
    main()
