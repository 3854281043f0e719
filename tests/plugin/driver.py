# SPDX-License-Identifier: Apache-2.0
"""Driver: a small engine that calls PdkvConnector exactly as vLLM's V1
scheduler and GPU model runner do at the vLLM commit recorded in
connector/python/pdkv/upstream.py, with torch tensors as the KV caches.  Not
vLLM: the smallest engine that exercises the connector's contract; the model
is a deterministic function of the tokens.

Call order per step (vllm/v1/core/sched/scheduler.py, Scheduler.schedule and
update_from_output; vllm/v1/worker/kv_connector_model_runner_mixin.py,
_get_kv_connector_output):
  scheduler  get_num_new_matched_tokens(request, num_local_computed)
             -> allocate (every KV-cache group; block 0 is vLLM's null
             block, never allocated) -> update_state_after_alloc(request,
             blocks, n_ext) (n_ext > 0 and async: WAITING_FOR_REMOTE_KVS)
             build_connector_meta(scheduler_output)
  workers    bind_connector_metadata(meta); forward; start_load_kv(ctx)
             (async loads start after the forward: has_sync_kv_loads false);
             wait_for_save(); get_transfer_results(finished_req_ids);
             get_block_ids_with_load_errors(); get_kv_connector_stats();
             clear_connector_metadata()
  scheduler  failed_recving (_handle_failed_recving: fail -> FINISHED_ERROR,
             recompute -> from token 0); invalid blocks
             (_handle_invalid_blocks: refused with several KV-cache groups,
             else kv_load_failure_policy from the first invalid block);
             update_connector_output(output); finished_recving -> the request
             resumes with num_computed_tokens = loaded tokens (the last
             prompt token recomputed); finished_sending -> free; the workers'
             stats merged, through to_dict() and build_kv_connector_stats()
             as between vLLM's processes, into build_prom_metrics()'s metrics
             (self.registry: what vLLM's /metrics would show).
  finishing  sliding-window groups' blocks before the window become the null
             block (remove_skipped_blocks); then, the connector being
             SupportsHMA, request_finished_all_groups(request, block_ids per
             group) -> (delay_free, params) (else request_finished(request,
             the one group's block_ids)).

groups: the model's KV-cache groups, e.g. ("full", ("swa", 32)): each group
has `layers` layers; layer l of every group shares tensor l (as vLLM's hybrid
allocator shares a tensor between one layer of each group)."""
import functools
import json
import math
import os
import sys
import threading
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "standins"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "connector", "python"))

import torch  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorRole,  # noqa: E402
                                                               supports_hma)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, MambaSpec, SlidingWindowSpec)
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
                 mla=False, hnd=True, device="cpu", groups=("full",)):
        self.layers, self.heads, self.head_size = layers, heads, head_size
        self.block_size, self.num_blocks, self.mla, self.hnd = block_size, num_blocks, mla, hnd
        self.device = device
        self.groups = [g if isinstance(g, tuple) else (g, 0) for g in groups]

    def kv_cache_config(self):
        """None for one full-attention group (the path without the hybrid
        manager), else vLLM's KVCacheConfig of the groups."""
        if self.groups == [("full", 0)]:
            return None
        specs = {"full": lambda w: FullAttentionSpec(self.block_size),
                 "swa": lambda w: SlidingWindowSpec(self.block_size, sliding_window=w),
                 "mamba": lambda w: MambaSpec(self.block_size)}
        return KVCacheConfig(self.num_blocks, [
            KVCacheGroupSpec([f"model.layers.{g * self.layers + l}.attn"
                              for l in range(self.layers)], specs[kind](w))
            for g, (kind, w) in enumerate(self.groups)])

    def first_kept_block(self, group, num_tokens):
        """Sliding window: blocks before this one hold no token of the window
        once num_tokens are computed (vLLM frees them)."""
        kind, w = self.groups[group]
        if kind != "swa":
            return 0
        return max(0, (num_tokens - w + 1) // self.block_size)


class Rank:
    """One TP worker: its caches and its connector (WORKER role)."""

    def __init__(self, cfg, geo, rank, tp, kv_cache_config=None):
        self.geo, self.rank = geo, rank
        if geo.mla:
            self.heads = [0]  # MLA: one latent vector per token, replicated
        else:
            per = geo.heads // tp
            self.heads = list(range(rank * per, (rank + 1) * per))
        nh = len(self.heads)
        self.tensors = []
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
            self.tensors.append(t)
        # one name per (group, layer); layer l of every group shares tensor l
        self.caches = {f"model.layers.{g * geo.layers + l}.attn": self.tensors[l]
                       for g in range(len(geo.groups)) for l in range(geo.layers)}
        parallel_state.set_rank(rank)
        self.conn = PdkvConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
        self.conn.register_kv_caches(self.caches)

    def planes(self, layer):
        t = self.tensors[layer]
        return [(0, t)] if self.geo.mla else [(0, t[0]), (1, t[1])]

    def write(self, group, tokens, positions, blocks):
        """Forward: the KV of tokens at positions into the group's slots."""
        if not positions:
            return
        bs = self.geo.block_size
        bidx = torch.tensor([blocks[p // bs] for p in positions])
        slot = torch.tensor([p % bs for p in positions])
        for layer in range(self.geo.layers):
            for plane, t in self.planes(layer):
                v = kv_values(tokens, positions, group * self.geo.layers + layer, plane,
                              self.heads, self.geo.head_size).to(t.device)
                if self.geo.mla:
                    t[bidx, slot] = v[:, 0]
                else:
                    t[bidx, slot] = v

    def expected_block(self, group, layer, plane, prompt, index):
        """What block `index` of a prompt holds after a full prefill."""
        bs = self.geo.block_size
        pos = list(range(index * bs, (index + 1) * bs))
        toks = [prompt[p] if p < len(prompt) else -1 for p in pos]
        v = kv_values(toks, pos, group * self.geo.layers + layer, plane, self.heads,
                      self.geo.head_size).to(self.geo.device)
        return v[:, 0] if self.geo.mla else v

    def check_blocks(self, group, prompt, blocks, indices):
        """The prompt's blocks at indices byte-exact; returns the mismatches."""
        bad = []
        for i in indices:
            for layer in range(self.geo.layers):
                for plane, t in self.planes(layer):
                    want = self.expected_block(group, layer, plane, prompt, i)
                    got = t[blocks[i]]
                    if not torch.equal(got.contiguous().view(torch.int16),
                                       want.contiguous().view(torch.int16)):
                        bad.append((self.rank, group, layer, plane, i, blocks[i]))
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


def tokens_of(req):
    """The prompt as the model sees it: token ids, or (prompt embeddings) the
    rows' integers."""
    return list(req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt_embeds)


class Engine:
    """Scheduler + TP workers in one process (vLLM runs the workers in their
    own processes; the calls and their order are the same)."""

    def __init__(self, engine_id, tp=1, geo=None, policy="fail", port=5610, host="127.0.0.1",
                 extra=None, dp_index=0):
        self.geo = geo or Geometry()
        self.tp = tp
        ktc = types.SimpleNamespace(
            engine_id=engine_id, kv_role="kv_both", kv_connector="PdkvConnector",
            kv_connector_module_path="pdkv.connector", kv_load_failure_policy=policy,
            kv_connector_extra_config=dict(extra or {}, side_channel_host=host,
                                           side_channel_port=port))
        # as vLLM's dense data-parallel engines: data_parallel_rank reset to
        # 0, data_parallel_index kept
        self.cfg = types.SimpleNamespace(
            kv_transfer_config=ktc,
            parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, data_parallel_rank=0,
                                                  data_parallel_index=dp_index),
            cache_config=types.SimpleNamespace(block_size=self.geo.block_size),
            model_config=types.SimpleNamespace(use_mla=self.geo.mla))
        self.policy = policy
        kcc = self.geo.kv_cache_config()
        self.ngroups = len(self.geo.groups)
        self.sched = PdkvConnector(self.cfg, KVConnectorRole.SCHEDULER, kcc)
        self.ranks = [Rank(self.cfg, self.geo, r, tp, kcc) for r in range(tp)]
        self.usable = self.geo.num_blocks - 1
        self.free = list(range(1, self.geo.num_blocks))  # block 0: the null block
        self.ever = set()
        self.mu = threading.Lock()
        self.waiting, self.running = [], []
        self.blocks = {}          # request id -> block ids per group
        self.delayed = {}         # request id -> block ids kept for a send
        self.finished_ids = set()
        self.recv_done, self.send_counts, self.recv_counts = set(), {}, {}
        self.loaded = {}          # request id -> per group, the blocks loaded remotely
        self.stats = {"loaded": 0, "load_failed": 0, "recomputed": 0, "verified": 0,
                      "corrupt": 0}
        self.failed_ids = set()
        self.recompute_from = {}
        self.corrupt = []
        self.pause_alloc = False
        self.stop_after_first = False   # every request's first token is a stop (EOS)
        self.on_token = None      # callback(request, token or None at the end)
        self.registry = CollectorRegistry()
        types_ = {Gauge: functools.partial(Gauge, registry=self.registry),
                  Counter: functools.partial(Counter, registry=self.registry),
                  Histogram: functools.partial(Histogram, registry=self.registry)}
        self.prom = PdkvConnector.build_prom_metrics(self.cfg, types_, ["model_name", "engine"],
                                                     {0: ["pdkv-test", "0"]})
        self.log_lines = []       # KVConnectorLogging's "KV Transfer metrics" lines

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
        n *= self.ngroups
        if self.pause_alloc or n > len(self.free):
            return None
        got, self.free = self.free[:n], self.free[n:]
        self.ever.update(got)
        k = n // self.ngroups
        return [got[g * k:(g + 1) * k] for g in range(self.ngroups)]

    def _release(self, rid):
        groups = self.blocks.pop(rid, None)
        for ids in groups or ():
            self.free.extend(b for b in ids if b != 0)

    def _finish(self, req, status):
        """Scheduler._free_request / _connector_finished."""
        req.status = status
        groups = self.blocks.get(req.request_id)
        ids = ()
        if groups is not None:
            ncomp = req.num_computed_tokens
            nblk = math.ceil(ncomp / self.geo.block_size)
            for g, blocks in enumerate(groups):  # remove_skipped_blocks
                for i in range(self.geo.first_kept_block(g, ncomp)):
                    if blocks[i] != 0:
                        self.free.append(blocks[i])
                        blocks[i] = 0
            ids = tuple(list(b[:nblk]) for b in groups)
        else:
            ids = tuple([] for _ in range(self.ngroups))
        if supports_hma(self.sched):
            delay, params = self.sched.request_finished_all_groups(req, ids)
        else:  # vLLM: the hybrid manager is off for such a connector
            assert self.ngroups == 1
            delay, params = self.sched.request_finished(req, ids[0])
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
                n = len(self.loaded.get(rid, [[]])[0]) * bs
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
                    nblk = math.ceil(req.num_prompt_tokens / bs)
                    self.loaded[rid] = [g[:nblk] for g in ids]
                    continue
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(req)
        out = types.SimpleNamespace(finished_req_ids=finished_req_ids,
                                    scheduled=[r.request_id for r in scheduled])
        meta = self.sched.build_connector_meta(out)
        # model runner, every TP worker (kv_connector_model_runner_mixin)
        finished_sending, finished_recving, failed, invalid = set(), set(), set(), set()
        stats = None
        for rk in self.ranks:
            rk.conn.bind_connector_metadata(meta)
            self._forward(rk, scheduled)
            rk.conn.start_load_kv(None)
            rk.conn.wait_for_save()
            res = rk.conn.get_transfer_results(finished_req_ids)
            invalid |= rk.conn.get_block_ids_with_load_errors()
            st = rk.conn.get_kv_connector_stats()
            if st is not None:
                stats = st if stats is None else stats.aggregate(st)
            rk.conn.clear_connector_metadata()
            failed |= res.failed_recving  # KVOutputAggregator: any rank's failure
            for rid in res.finished_sending:  # done once every worker says so
                self.send_counts[rid] = self.send_counts.get(rid, 0) + 1
                if self.send_counts[rid] == self.tp:
                    finished_sending.add(self.send_counts.pop(rid) and rid)
            for rid in res.finished_recving:
                self.recv_counts[rid] = self.recv_counts.get(rid, 0) + 1
                if self.recv_counts[rid] == self.tp:
                    finished_recving.add(self.recv_counts.pop(rid) and rid)
        if failed:
            self._failed_recving(failed)
        if invalid:
            self._invalid_blocks(invalid)
        self.sched.update_connector_output(types.SimpleNamespace(
            finished_sending=finished_sending, finished_recving=finished_recving,
            failed_recving=failed, invalid_block_ids=invalid))
        if stats is not None and not stats.is_empty() and self.prom is not None:
            data = json.loads(json.dumps(stats.to_dict()))  # worker -> logger process
            self.prom.observe(data, 0)
            self.log_lines.append(PdkvConnector.build_kv_connector_stats(data).reduce())
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
            if self.stop_after_first:
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_STOPPED)
            elif len(req.output_token_ids) >= req.max_tokens:
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
        return bool(self.waiting or self.running or self.delayed)

    def _verify(self, req):
        """At the end of a load: every loaded block byte-exact on every rank
        (sliding-window groups: the blocks inside the window)."""
        groups = self.loaded.get(req.request_id, [])
        bad = []
        for g, ids in enumerate(groups):
            first = self.geo.first_kept_block(g, req.num_prompt_tokens)
            for rk in self.ranks:
                bad += rk.check_blocks(g, tokens_of(req), ids, range(first, len(ids)))
        if bad:
            self.stats["corrupt"] += 1
            self.corrupt.append((req.request_id, bad[:4]))
        else:
            self.stats["verified"] += 1

    def untouched(self):
        with self.mu:
            never = [b for b in range(self.geo.num_blocks) if b not in self.ever]
            return [x for rk in self.ranks for x in rk.untouched(never)], len(never)

    def _fail_load(self, req, recompute_from):
        """kv_load_failure_policy: fail, or recompute from a token."""
        if req.request_id not in self.failed_ids:
            self.failed_ids.add(req.request_id)
            self.stats["load_failed"] += 1
        if self.policy == "fail":
            self.waiting.remove(req)
            self.recv_done.discard(req.request_id)
            self._finish(req, RequestStatus.FINISHED_ERROR)
        else:
            req.num_computed_tokens = min(req.num_computed_tokens, recompute_from)
            frm = self.recompute_from.get(req.request_id, recompute_from)
            self.recompute_from[req.request_id] = min(frm, recompute_from)

    def _failed_recving(self, failed):
        """Scheduler._handle_failed_recving."""
        for req in list(self.waiting):
            if req.request_id not in failed or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            self._fail_load(req, 0)

    def _invalid_blocks(self, invalid):
        """Scheduler._handle_invalid_blocks with kv_load_failure_policy."""
        if self.ngroups > 1:
            raise RuntimeError("A KV connector reported block-level load failures "
                               "(invalid_block_ids) which is not supported for models with "
                               "multiple KV cache groups.")
        bs = self.geo.block_size
        for req in list(self.waiting):
            ids = self.loaded.get(req.request_id, [[]])[0]
            if not ids or not set(ids) & invalid or \
                    req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            self._fail_load(req, min(i for i, b in enumerate(ids) if b in invalid) * bs)

    def _forward(self, rk, scheduled):
        bs = self.geo.block_size
        for req in scheduled:
            toks = tokens_of(req) + req.output_token_ids
            start = req.num_computed_tokens
            for g, ids in enumerate(self.blocks[req.request_id]):
                if start < req.num_tokens:  # prefill (or the rest of it): whole blocks, pad too
                    end = math.ceil(req.num_tokens / bs) * bs
                    pos = [p for p in range(start, end) if ids[p // bs] != 0]
                    rk.write(g, [toks[p] if p < len(toks) else -1 for p in pos], pos, ids)
                else:
                    p = req.num_tokens + len(req.output_token_ids) - 1
                    if p >= req.num_tokens:
                        rk.write(g, [toks[p]], [p], ids)

    def _sample(self, req):
        """The next token: a digest of the prompt's KV in this engine's blocks
        (rank 0, group 0, layer 0, K), so a wrong transfer changes the answer."""
        rk = self.ranks[0]
        ids = self.blocks[req.request_id][0][:math.ceil(req.num_tokens / self.geo.block_size)]
        t = rk.planes(0)[0][1][ids].to(torch.float32).cpu()
        w = torch.arange(1, t.numel() + 1, dtype=torch.float32).view(t.shape) % 97
        return (int((t * w).sum().item()) + len(req.output_token_ids) * 13) % 50000

    def state(self):
        with self.mu:
            return {"free_blocks": len(self.free), "num_blocks": self.usable,
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
