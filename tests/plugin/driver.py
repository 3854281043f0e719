# SPDX-License-Identifier: Apache-2.0
"""Driver: a small engine that calls PdkvConnector exactly as vLLM's V1
scheduler and GPU model runner do (vLLM commit 00f4240e), with torch tensors
as the KV caches.  Not vLLM: the smallest engine that exercises the
connector's contract; the model is a deterministic function of the tokens.

Call order per step (vllm/v1/core/sched/scheduler.py, Scheduler.schedule and
update_from_output; vllm/v1/worker/kv_connector_model_runner_mixin.py,
_get_kv_connector_output):
  scheduler  get_num_new_matched_tokens(request, num_local_computed)
             -> allocate -> update_state_after_alloc(request, blocks, n_ext)
             (n_ext > 0 and async: status WAITING_FOR_REMOTE_KVS)
             build_connector_meta(scheduler_output)
  workers    bind_connector_metadata(meta); forward; start_load_kv(ctx)
             (async loads start after the forward: has_sync_kv_loads false);
             wait_for_save(); get_finished(finished_req_ids);
             get_block_ids_with_load_errors(); clear_connector_metadata()
  scheduler  update_connector_output(output); invalid blocks ->
             kv_load_failure_policy (fail: FINISHED_ERROR; recompute: the
             request recomputes from the first invalid block); finished_recving
             -> the request resumes with num_computed_tokens = loaded tokens
             (the last prompt token recomputed); finished_sending -> free.
  finishing  request_finished(request, block_ids) -> (delay_free, params)
"""
import math
import os
import sys
import threading
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "standins"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "connector", "python"))

import torch  # noqa: E402

from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from pdkv.connector import PdkvConnector  # noqa: E402

SENTINEL = -3.0
DTYPE = torch.float16


def kv_values(tokens, positions, layer, plane, heads, head_size):
    """The model: KV of tokens at positions, [T, len(heads), head_size], small
    integers (exact in float16); pad token -1 fills a block's unused slots."""
    t = torch.tensor(tokens, dtype=torch.int64).view(-1, 1, 1)
    p = torch.tensor(positions, dtype=torch.int64).view(-1, 1, 1)
    h = torch.tensor(heads, dtype=torch.int64).view(1, -1, 1)
    d = torch.arange(head_size, dtype=torch.int64).view(1, 1, -1)
    v = (t * 31 + p * 7 + layer * 131 + plane * 17 + h * 5 + d * 3) % 509 - 254
    return v.to(DTYPE)


class Geometry:
    def __init__(self, layers=2, heads=4, head_size=8, block_size=16, num_blocks=256,
                 mla=False, hnd=True, device="cpu"):
        self.layers, self.heads, self.head_size = layers, heads, head_size
        self.block_size, self.num_blocks, self.mla, self.hnd = block_size, num_blocks, mla, hnd
        self.device = device


class Rank:
    """One TP worker: its caches and its connector (WORKER role)."""

    def __init__(self, cfg, geo, rank, tp):
        self.geo, self.rank = geo, rank
        if geo.mla:
            self.heads = [0]  # MLA: one latent vector per token, replicated
        else:
            per = geo.heads // tp
            self.heads = list(range(rank * per, (rank + 1) * per))
        nh = len(self.heads)
        self.caches = {}
        for layer in range(geo.layers):
            if geo.mla:
                t = torch.full((geo.num_blocks, geo.block_size, geo.head_size), SENTINEL, dtype=DTYPE,
                               device=geo.device)
            elif geo.hnd:  # physical [2, blocks, heads, tokens, head]; logical FlashAttention shape
                t = torch.full((2, geo.num_blocks, nh, geo.block_size, geo.head_size), SENTINEL,
                               dtype=DTYPE, device=geo.device).permute(0, 1, 3, 2, 4)
            else:
                t = torch.full((2, geo.num_blocks, geo.block_size, nh, geo.head_size), SENTINEL,
                               dtype=DTYPE, device=geo.device)
            self.caches[f"model.layers.{layer}.self_attn.attn"] = t
        parallel_state.set_rank(rank)
        self.conn = PdkvConnector(cfg, KVConnectorRole.WORKER, None)
        self.conn.register_kv_caches(self.caches)

    def planes(self, layer):
        t = self.caches[f"model.layers.{layer}.self_attn.attn"]
        return [(0, t)] if self.geo.mla else [(0, t[0]), (1, t[1])]

    def write(self, tokens, positions, blocks):
        """Forward: the KV of tokens at positions into their slots."""
        if not positions:
            return
        bs = self.geo.block_size
        bidx = torch.tensor([blocks[p // bs] for p in positions])
        slot = torch.tensor([p % bs for p in positions])
        for layer in range(self.geo.layers):
            for plane, t in self.planes(layer):
                v = kv_values(tokens, positions, layer, plane, self.heads,
                              self.geo.head_size).to(t.device)
                if self.geo.mla:
                    t[bidx, slot] = v[:, 0]
                else:
                    t[bidx, slot] = v

    def expected_block(self, layer, plane, prompt, index):
        """What block `index` of a prompt holds after a full prefill."""
        bs = self.geo.block_size
        pos = list(range(index * bs, (index + 1) * bs))
        toks = [prompt[p] if p < len(prompt) else -1 for p in pos]
        v = kv_values(toks, pos, layer, plane, self.heads, self.geo.head_size).to(self.geo.device)
        return v[:, 0] if self.geo.mla else v

    def check_blocks(self, prompt, blocks, nblocks):
        """Every block of the prompt byte-exact; returns the mismatches."""
        bad = []
        for i in range(nblocks):
            for layer in range(self.geo.layers):
                for plane, t in self.planes(layer):
                    want = self.expected_block(layer, plane, prompt, i)
                    got = t[blocks[i]]
                    if not torch.equal(got.contiguous().view(torch.int16),
                                       want.contiguous().view(torch.int16)):
                        bad.append((self.rank, layer, plane, i, blocks[i]))
        return bad

    def untouched(self, block_ids):
        """Blocks never allocated: still all sentinel."""
        bad = []
        for layer in range(self.geo.layers):
            for plane, t in self.planes(layer):
                sub = t[list(block_ids)]
                if sub.numel() and not bool((sub == SENTINEL).all()):
                    bad.append((self.rank, layer, plane))
        return bad


class Engine:
    """Scheduler + TP workers in one process (vLLM runs the workers in their
    own processes; the calls and their order are the same)."""

    def __init__(self, engine_id, tp=1, geo=None, policy="fail", port=5610, host="127.0.0.1",
                 extra=None):
        self.geo = geo or Geometry()
        self.tp = tp
        ktc = types.SimpleNamespace(
            engine_id=engine_id, kv_role="kv_both", kv_connector="PdkvConnector",
            kv_connector_module_path="pdkv.connector", kv_load_failure_policy=policy,
            kv_connector_extra_config=dict(extra or {}, side_channel_host=host,
                                           side_channel_port=port))
        self.cfg = types.SimpleNamespace(
            kv_transfer_config=ktc,
            parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, data_parallel_rank=0),
            cache_config=types.SimpleNamespace(block_size=self.geo.block_size),
            model_config=types.SimpleNamespace(use_mla=self.geo.mla))
        self.policy = policy
        self.sched = PdkvConnector(self.cfg, KVConnectorRole.SCHEDULER, None)
        self.ranks = [Rank(self.cfg, self.geo, r, tp) for r in range(tp)]
        self.free = list(range(self.geo.num_blocks))
        self.ever = set()
        self.mu = threading.Lock()
        self.waiting, self.running = [], []
        self.blocks = {}          # request id -> block ids
        self.delayed = {}         # request id -> block ids kept for a send
        self.finished_ids = set()
        self.recv_done, self.send_counts, self.recv_counts = set(), {}, {}
        self.loaded = {}          # request id -> blocks loaded remotely
        self.stats = {"loaded": 0, "load_failed": 0, "recomputed": 0, "verified": 0,
                      "corrupt": 0}
        self.recompute_from = {}
        self.corrupt = []
        self.pause_alloc = False
        self.on_token = None      # callback(request, token or None at the end)

    # -- requests -------------------------------------------------------------
    def add(self, req):
        with self.mu:
            self.waiting.append(req)

    def abort(self, rid):
        with self.mu:
            for q in (self.waiting, self.running):
                for req in q:
                    if (req.request_id == rid or f"-{rid}-" in req.request_id) and req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                        q.remove(req)
                        self._finish(req, RequestStatus.FINISHED_ABORTED)
                        return True
        return False

    def _alloc(self, n):
        if self.pause_alloc or n > len(self.free):
            return None
        got, self.free = self.free[:n], self.free[n:]
        self.ever.update(got)
        return got

    def _release(self, rid):
        ids = self.blocks.pop(rid, None)
        if ids:
            self.free.extend(ids)

    def _finish(self, req, status):
        """Scheduler._free_request: request_finished decides when blocks go."""
        req.status = status
        ids = self.blocks.get(req.request_id, [])
        delay, params = self.sched.request_finished(req, list(ids))
        self.finished_ids.add(req.request_id)
        if delay:
            self.delayed[req.request_id] = True
        else:
            self._release(req.request_id)
        if self.on_token:
            self.on_token(req, None, params)

    # -- one engine step ------------------------------------------------------
    def step(self):
        with self.mu:
            return self._step()

    def _step(self):
        bs = self.geo.block_size
        finished_req_ids, self.finished_ids = self.finished_ids, set()
        scheduled = []
        for req in list(self.running):
            scheduled.append(req)
        for req in list(self.waiting):
            rid = req.request_id
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if rid not in self.recv_done:
                    continue
                self.recv_done.discard(rid)
                # Scheduler._update_waiting_for_remote_kv: loaded blocks count
                # as computed, the last prompt token is computed here
                n = len(self.loaded.get(rid, [])) * bs
                n = min(n + req.num_computed_tokens, req.num_tokens)
                if rid in self.recompute_from:
                    n = min(n, self.recompute_from.pop(rid))
                    self.stats["recomputed"] += 1
                else:
                    self._verify(req)
                req.num_computed_tokens = n - 1 if n == req.num_tokens else n
                req.status = RequestStatus.WAITING
            if rid not in self.blocks:
                ext, load_async = self.sched.get_num_new_matched_tokens(req, 0)
                if ext is None:
                    continue
                ids = self._alloc(math.ceil((req.num_tokens + req.max_tokens) / bs))
                if ids is None:
                    continue
                self.blocks[rid] = ids
                self.sched.update_state_after_alloc(req, KVCacheBlocks(ids), ext)
                if load_async and ext > 0:
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    nblk = math.ceil(len(req.prompt_token_ids) / bs)
                    self.loaded[rid] = ids[:nblk]
                    continue
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(req)
        out = types.SimpleNamespace(finished_req_ids=finished_req_ids,
                                    scheduled=[r.request_id for r in scheduled])
        meta = self.sched.build_connector_meta(out)
        # model runner, every TP worker (kv_connector_model_runner_mixin)
        finished_sending, finished_recving, invalid = set(), set(), set()
        for rk in self.ranks:
            rk.conn.bind_connector_metadata(meta)
            self._forward(rk, scheduled)
            rk.conn.start_load_kv(None)
            rk.conn.wait_for_save()
            s, r = rk.conn.get_finished(finished_req_ids)
            invalid |= rk.conn.get_block_ids_with_load_errors()
            rk.conn.clear_connector_metadata()
            for rid in s or ():  # KVOutputAggregator: done once every worker says so
                self.send_counts[rid] = self.send_counts.get(rid, 0) + 1
                if self.send_counts[rid] == self.tp:
                    finished_sending.add(self.send_counts.pop(rid) and rid)
            for rid in r or ():
                self.recv_counts[rid] = self.recv_counts.get(rid, 0) + 1
                if self.recv_counts[rid] == self.tp:
                    finished_recving.add(self.recv_counts.pop(rid) and rid)
        self.sched.update_connector_output(types.SimpleNamespace(
            finished_sending=finished_sending, finished_recving=finished_recving,
            invalid_block_ids=invalid))
        if invalid:
            self._invalid_blocks(invalid)
        for rid in finished_recving:
            if any(r.request_id == rid for r in self.waiting):
                self.recv_done.add(rid)
                self.stats["loaded"] += 1
        for rid in finished_sending:
            if self.delayed.pop(rid, None):
                self._release(rid)
        # outputs
        for req in scheduled:
            if req.num_computed_tokens < req.num_tokens:
                req.num_computed_tokens = req.num_tokens
            tok = self._sample(req)
            req.output_token_ids.append(tok)
            if self.on_token:
                self.on_token(req, tok, None)
            if len(req.output_token_ids) >= req.max_tokens:
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
        return bool(self.waiting or self.running or self.delayed)

    def _verify(self, req):
        """At the end of a load: every loaded block byte-exact on every rank."""
        ids = self.loaded.get(req.request_id, [])
        bad = []
        for rk in self.ranks:
            bad += rk.check_blocks(req.prompt_token_ids, ids, len(ids))
        if bad:
            self.stats["corrupt"] += 1
            self.corrupt.append((req.request_id, bad[:4]))
        else:
            self.stats["verified"] += 1

    def untouched(self):
        with self.mu:
            never = [b for b in range(self.geo.num_blocks) if b not in self.ever]
            return [x for rk in self.ranks for x in rk.untouched(never)], len(never)

    def _invalid_blocks(self, invalid):
        """Scheduler._handle_invalid_blocks with kv_load_failure_policy."""
        bs = self.geo.block_size
        for req in list(self.waiting):
            ids = self.loaded.get(req.request_id)
            if not ids or not set(ids) & invalid:
                continue
            self.stats["load_failed"] += 1
            if self.policy == "fail":
                self.waiting.remove(req)
                self.recv_done.discard(req.request_id)
                self._finish(req, RequestStatus.FINISHED_ERROR)
            else:
                first = min(i for i, b in enumerate(ids) if b in invalid)
                self.recompute_from[req.request_id] = first * bs

    def _forward(self, rk, scheduled):
        for req in scheduled:
            ids = self.blocks[req.request_id]
            toks = req.prompt_token_ids + req.output_token_ids
            start = req.num_computed_tokens
            if start < req.num_tokens:  # prefill (or the rest of it): whole blocks, pad too
                end = math.ceil(req.num_tokens / self.geo.block_size) * self.geo.block_size
                pos = list(range(start, end))
                rk.write([toks[p] if p < len(toks) else -1 for p in pos], pos, ids)
            else:
                p = req.num_tokens + len(req.output_token_ids) - 1
                if p >= req.num_tokens:
                    rk.write([toks[p]], [p], ids)

    def _sample(self, req):
        """The next token: a digest of the prompt's KV in this engine's blocks
        (rank 0, layer 0, K), so a wrong transfer changes the answer."""
        rk = self.ranks[0]
        ids = self.blocks[req.request_id][:math.ceil(req.num_tokens / self.geo.block_size)]
        t = rk.planes(0)[0][1][ids].to(torch.float32).cpu()
        w = torch.arange(1, t.numel() + 1, dtype=torch.float32).view(t.shape) % 97
        return (int((t * w).sum().item()) + len(req.output_token_ids) * 13) % 50000

    def state(self):
        with self.mu:
            return {"free_blocks": len(self.free), "num_blocks": self.geo.num_blocks,
                    "waiting": len(self.waiting), "running": len(self.running),
                    "delayed": len(self.delayed), **self.stats,
                    "remote_wait": sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                                       for r in self.waiting),
                    "loading": sum(len(r.conn.worker.loading) for r in self.ranks),
                    "pending_fetches": sum(r.conn.worker.agent.stat("pending_fetches")
                                           for r in self.ranks),
                    "published_now": sum(r.conn.worker.agent.stat("published_now")
                                         for r in self.ranks)}

    def shutdown(self):
        for r in self.ranks:
            r.conn.shutdown()
