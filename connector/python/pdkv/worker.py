# SPDX-License-Identifier: Apache-2.0
"""PdkvConnector's worker half: one libkvconnector agent per TP rank, driven
by its progress thread; publishes, fetches, renews leases, and reports what
ended to vLLM (get_transfer_results) and its figures (pdkv/stats.py)."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from pdkv import lib as kvc
from pdkv.config import ParamsError, Settings, read_secret, resolve_allowed
from pdkv.stats import PdkvKVConnectorStats

__all__ = ["Worker"]

logger = logging.getLogger("pdkv.connector")
Plan = List[Tuple[int, Optional[Tuple[int, int, int, int]], bool]]


def _region_of(t: Any) -> Tuple[int, int, int, int]:
    """(base, length, num_blocks, block_bytes) of a tensor whose dim 0 counts
    blocks; raises ValueError if a block is not one dense run."""
    elem = t.element_size()
    nb = t.shape[0]
    span = 1 + sum((t.shape[i] - 1) * t.stride(i) for i in range(1, t.dim()))
    if t.stride(0) != span or any(s <= 0 for s in t.stride()):
        raise ValueError(f"KV tensor {tuple(t.shape)} strides {t.stride()}: a block is not "
                         "one contiguous run")
    return t.data_ptr(), nb * span * elem, nb, span * elem


@dataclasses.dataclass
class _Load:
    """One request's load on this rank."""
    left: int                   # fetches not ended (+1 while they are being started)
    failed: bool
    local_block_ids: List[int]
    awaiting: bool              # vLLM waits for the request in finished_recving
    started: float = dataclasses.field(default_factory=time.monotonic)
    bytes: int = 0


class Worker:
    def __init__(self, settings: Settings, num_groups: int = 1):
        self.s = settings
        self.num_groups = num_groups
        self.rank = int(get_tensor_model_parallel_rank())
        self.agent: Optional[kvc.Agent] = None
        self.mu = threading.Lock()
        self.done_send: Set[str] = set()
        self.done_recv: Set[str] = set()
        self.failed_recv: Set[str] = set()
        self.invalid: Set[int] = set()
        self.xfers: Dict[int, str] = {}        # xfer_id -> request id
        self.loading: Dict[str, _Load] = {}
        self.published: Set[str] = set()
        self.stats = PdkvKVConnectorStats()
        self.renewals_accepted = 0
        self.hnd = True
        self.num_regions = 0
        self.cuda = False

    # -- registration ---------------------------------------------------------
    def register(self, kv_caches: Dict[str, Any]) -> None:
        regions: List[Tuple[int, int, Optional[int]]] = []
        seen = set()
        nb, dtype, hd = None, None, None
        for name, t in kv_caches.items():
            if self.s.use_mla or t.dim() == 3:
                planes = [t]                      # MLA: [num_blocks, block_size, head_size]
            elif t.dim() == 5 and t.shape[0] == 2:
                planes = [t[0], t[1]]             # [2, num_blocks, block_size, heads, head]
                # HND: heads outside tokens inside a block (stride order)
                self.hnd = self.hnd and t.stride(3) > t.stride(2)
            else:
                planes = [t]                      # [num_blocks, ...]: one region per layer
                self.hnd = False
            for p in planes:
                base, length, n, _bb = _region_of(p)
                if nb is not None and n != nb:
                    raise ValueError(f"layer {name}: {n} blocks, others {nb}")
                nb = n
                if (base, length) in seen:        # hybrid models: groups share tensors
                    continue
                seen.add((base, length))
                dev = (p.device.index or 0) if p.is_cuda else None
                regions.append((base, length, dev))
            dtype, hd = str(t.dtype).replace("torch.", ""), t.shape[-1]
        if not regions:
            raise ValueError("no KV caches to register")
        secret = read_secret(self.s.secret_file) if self.s.secret_file else None
        tag = (f"pdkv1/{'mla' if self.s.use_mla else 'kv'}/{dtype}/{len(kv_caches)}L/"
               f"{len(regions)}R/h{hd}/bs{self.s.block_size}/{'HND' if self.hnd else 'NHD'}")
        try:
            self.agent = kvc.Agent(self.s.engine_id, listen_host=self.s.host,
                                   listen_port=self.s.base_port + self.rank,
                                   tp_size=self.s.tp_size, layout_tag=tag, secret=secret,
                                   lease_ms=self.s.lease_ms, expiry_ms=self.s.expiry_ms,
                                   xfer_timeout_ms=self.s.xfer_timeout_ms,
                                   connect_timeout_ms=self.s.connect_timeout_ms)
        finally:
            if secret is not None:
                secret[:] = bytes(len(secret))
        self.agent.register_regions(nb, regions)
        self.num_regions = len(regions)
        self.cuda = regions[0][2] is not None
        self.agent.start(self._on_event)
        logger.info("pdkv rank %d: %d regions x %d blocks, side channel %s:%d, library %s",
                    self.rank, len(regions), nb, self.s.host, self.agent.port,
                    kvc.library_path())

    # -- events (progress thread) ---------------------------------------------
    def _on_event(self, ev: kvc.Event) -> None:
        with self.mu:
            if ev.type in (kvc.EventType.RELEASED, kvc.EventType.EXPIRED):
                if ev.request_id in self.published:
                    self.published.discard(ev.request_id)
                    self.done_send.add(ev.request_id)
                if ev.type == kvc.EventType.EXPIRED:
                    self.stats.count("num_kv_expired_reqs")
                    logger.warning("pdkv: publication %s expired: %s", ev.request_id, ev.message)
                return
            if ev.type not in (kvc.EventType.FETCH_DONE, kvc.EventType.FETCH_FAILED):
                return
            rid = self.xfers.pop(ev.xfer_id, None)
            if rid is None or rid not in self.loading:
                return
            st = self.loading[rid]
            if ev.type == kvc.EventType.FETCH_FAILED:
                st.failed = True
                logger.warning("pdkv: load of %s failed: %s %s", rid, kvc.status_str(ev.status),
                               ev.message)
            else:
                st.bytes += ev.bytes
            st.left -= 1
            if st.left == 0:
                self._finish_load(rid)

    def _finish_load(self, rid: str) -> None:  # self.mu held
        st = self.loading.pop(rid)
        if st.failed:
            if st.awaiting:
                self.stats.count("num_failed_transfers")
        elif st.local_block_ids:
            self.stats.record_transfer(time.monotonic() - st.started, st.bytes,
                                       len(st.local_block_ids))
        if not st.awaiting:
            return
        if st.failed:
            self.failed_recv.add(rid)
            self.invalid.update(st.local_block_ids)
        self.done_recv.add(rid)

    # -- per step ------------------------------------------------------------
    def _plan(self, params: Dict[str, Any]) -> Plan:
        """[(remote_rank, parts or None, read)] for this rank; read=False: an
        MLA replica that rank 0's read already covers: a fetch without
        blocks releases it (with wait_ms the producer holds that release if
        it comes before the publication)."""
        tp = params.get("tp_size", 1)
        d, r = self.s.tp_size, self.rank
        p = tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 0 else 1
        if d >= p:
            if d % p:
                raise ValueError(f"decode TP {d} not a multiple of prefill TP {p}")
            k = d // p
            if self.s.use_mla or k == 1:
                return [(r // k, None, True)]
            if not self.hnd:
                raise ValueError("heterogeneous TP needs the HND KV-cache layout")
            return [(r // k, (k, r % k, 1, 0), True)]
        if p % d:
            raise ValueError(f"prefill TP {p} not a multiple of decode TP {d}")
        k = p // d
        if self.s.use_mla:
            return [(r * k + j, None, j == 0) for j in range(k)]
        if not self.hnd:
            raise ValueError("heterogeneous TP needs the HND KV-cache layout")
        return [(r * k + j, (1, 0, k, j), True) for j in range(k)]

    def _target(self, params: Dict[str, Any]) -> Dict[str, Any]:
        """params with remote_host as the allowed address to connect to."""
        return dict(params, remote_host=resolve_allowed(params["remote_host"],
                                                        self.s.networks))

    def start(self, meta: Any) -> None:
        if self.agent is None:
            return
        stream = None
        if self.cuda:
            import torch
            stream = torch.cuda.current_stream().cuda_stream
        for rid, (blocks, token) in meta.reqs_to_send.items():
            with self.mu:
                self.published.add(rid)
            try:
                self.agent.publish(rid, blocks, token=token, cuda_stream=stream)
            except kvc.KvcError as e:
                logger.error("pdkv: publish %s failed: %s: its blocks are freed", rid, e)
                with self.mu:
                    self.published.discard(rid)
                    self.done_send.add(rid)
        for rid, rr in meta.reqs_to_recv.items():
            self._load(rid, rr, stream)
        for rid, params in meta.reqs_to_renew.items():
            try:
                target = self._target(params)
                for rank, _parts, _read in self._plan(params):
                    self.agent.lease_renew(target, remote_rank=rank)
                    with self.mu:
                        self.stats.count("num_lease_renewals_sent")
            except (kvc.KvcError, ValueError) as e:
                logger.warning("pdkv: lease renewal of %s: %s", rid, e)

    def _load(self, rid: str, rr: Any, stream: Optional[int]) -> None:
        plan: Optional[Plan] = None
        try:
            if rr.refused is not None:
                raise ParamsError(rr.refused)
            plan = self._plan(rr.params)
            target = dict(self._target(rr.params), remote_block_ids=rr.remote_block_ids)
        except ValueError as e:  # ParamsError included: nothing connects
            logger.error("pdkv: load of %s refused: %s", rid, e)
            plan = None
        with self.mu:  # one count held by this call until every fetch is started
            self.loading[rid] = _Load(1, plan is None, list(rr.local_block_ids), rr.awaiting)
        for rank, parts, read in plan or []:
            local = rr.local_block_ids if read else []
            try:
                with self.mu:  # the event may come before fetch() returns
                    xid = self.agent.fetch(target, local, cuda_stream=stream, remote_rank=rank,
                                           parts=parts, wait_ms=self.s.wait_ms)
                    self.xfers[xid] = rid
                    self.loading[rid].left += 1
            except kvc.KvcError as e:
                logger.error("pdkv: load of %s from rank %d: %s", rid, rank, e)
                with self.mu:
                    self.loading[rid].failed = True
        with self.mu:
            self.loading[rid].left -= 1
            if self.loading[rid].left == 0:
                self._finish_load(rid)

    def results(self) -> KVConnectorTransferResults:
        """What ended since the last call: sends, loads (failed ones too, and
        those again in failed_recving)."""
        with self.mu:
            out = KVConnectorTransferResults(finished_sending=self.done_send,
                                             finished_recving=self.done_recv,
                                             failed_recving=self.failed_recv)
            self.done_send, self.done_recv, self.failed_recv = set(), set(), set()
        return out

    def load_errors(self) -> Set[int]:
        """Failed loads' local blocks, for runners that read only these.  Not
        with several KV-cache groups: block ids are per group there and vLLM
        refuses them (failed_recving says it instead)."""
        with self.mu:
            inv, self.invalid = self.invalid, set()
        return inv if self.num_groups == 1 else set()

    def take_stats(self) -> Optional[PdkvKVConnectorStats]:
        if self.agent is not None:
            n = self.agent.stat(kvc.Stat.LEASE_RENEWALS)
            with self.mu:
                self.stats.count("num_lease_renewals_accepted", n - self.renewals_accepted)
                self.renewals_accepted = n
        with self.mu:
            if self.stats.is_empty():
                return None
            return self.stats.clone_and_reset()

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
