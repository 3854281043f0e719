# SPDX-License-Identifier: Apache-2.0
"""PdkvConnector: libkvconnector as a vLLM V1 KV connector (KVConnectorBase_V1).

Load it with
  --kv-transfer-config '{"kv_connector":"PdkvConnector",
                         "kv_connector_module_path":"pdkv.connector",
                         "kv_role":"kv_both"}'

Written against vLLM commit 00f4240ee6458263d76cf51ca7901ce1350bb4d1
(vllm/distributed/kv_transfer/kv_connector/v1/base.py).  The flow follows the
pull model of vLLM's NIXL connector:

  prefill (request with kv_transfer_params.do_remote_decode): when it finishes
  by length cap, request_finished() keeps its blocks, mints the publication's
  token and returns kv_transfer_params (do_remote_prefill, remote_block_ids,
  remote_engine_id, remote_host, remote_port, remote_request_id, tp_size,
  remote_kv_token); the next step's metadata tells every worker to publish the
  blocks with that token (kvc_publish, KVC_PUBLISH_FIELD_TOKEN).  The blocks
  are returned to vLLM (get_finished: finished_sending) once decode notified
  (KVC_EV_RELEASED) or the publication expired.

  decode (request with do_remote_prefill): get_num_new_matched_tokens reports
  the prompt tokens not computed locally as loaded asynchronously;
  update_state_after_alloc records the allocated blocks; the metadata hands
  the load to the workers, which start kvc_fetch (registered at the producer
  even if it has not published yet, KVC_FETCH_FIELD_WAIT) and report it in
  finished_recving; failed blocks go to get_block_ids_with_load_errors, and
  vLLM's scheduler applies kv_load_failure_policy (fail / recompute).

Imports from vllm are only the four names below: the test suite's stand-ins
define exactly those (tests/plugin/standins), so drift shows.
"""
import dataclasses
import logging
import os
import secrets
import threading
import time

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.request import RequestStatus

from pdkv import lib as kvc

logger = logging.getLogger("pdkv.connector")

REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
            "remote_port", "remote_kv_token")
ENV_HOST, ENV_PORT = "PDKV_SIDE_CHANNEL_HOST", "PDKV_SIDE_CHANNEL_PORT"
ENV_SECRET_FILE = "PDKV_SECRET_FILE"
DEFAULT_PORT = 5610


@dataclasses.dataclass
class RecvReq:
    local_block_ids: list
    params: dict
    notify_only: bool = False


@dataclasses.dataclass
class PdkvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one step: what to publish, fetch, notify, renew."""
    reqs_to_send: dict = dataclasses.field(default_factory=dict)   # id -> (blocks, token)
    reqs_to_recv: dict = dataclasses.field(default_factory=dict)   # id -> RecvReq
    reqs_to_renew: dict = dataclasses.field(default_factory=dict)  # id -> params


def _side_channel(vllm_config, extra):
    host = os.environ.get(ENV_HOST) or extra.get("side_channel_host") or "127.0.0.1"
    port = int(os.environ.get(ENV_PORT) or extra.get("side_channel_port") or DEFAULT_PORT)
    pc = vllm_config.parallel_config
    dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
    # rank r of this engine listens on port + r (include/kvconnector.h,
    # KVC_FETCH_FIELD_REMOTE_RANK); data-parallel engines get disjoint ranges.
    return host, port + dp_rank * int(pc.tensor_parallel_size)


def _params_missing(params):
    """The required kv_transfer_params keys that are absent or empty ([]: the
    params are complete)."""
    return [k for k in REQUIRED if params.get(k) in (None, "")]


class PdkvConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        self.engine_id = str(ktc.engine_id)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.use_mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        self.host, self.base_port = _side_channel(vllm_config, self.extra)
        self.wait_ms = int(self.extra.get("fetch_wait_ms", 30000))
        self.lease_ms = int(self.extra.get("lease_ms", 30000))
        self.renew_s = float(self.extra.get("lease_renew_s", self.lease_ms / 3000.0))
        if role == KVConnectorRole.SCHEDULER:
            self._send = {}
            self._recv = {}
            self._waiting = {}   # decode requests queued, not allocated yet: renew
            self._last_renew = time.monotonic()
        else:
            self.worker = _Worker(self)

    # ------------------------------------------------------ scheduler side --
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if _params_missing(params):
            return 0, False
        count = len(request.prompt_token_ids) - num_computed_tokens
        if count > 0:
            self._waiting[request.request_id] = params
            return count, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        rid = request.request_id
        self._waiting.pop(rid, None)
        missing = _params_missing(params)
        if missing:
            logger.warning("request %s: invalid kv_transfer_params, missing %s: prefill recomputed",
                           rid, ",".join(missing))
        elif num_external_tokens > 0:
            local = list(blocks.get_unhashed_block_ids())
            nremote = len(params["remote_block_ids"])
            if len(local) > nremote:
                local = local[:nremote]
            self._recv[rid] = RecvReq(local, dict(params))
        else:  # everything hit locally: still tell prefill to free its blocks
            self._recv[rid] = RecvReq([], dict(params), notify_only=True)
        params["do_remote_prefill"] = False  # second call after the load: nothing to do

    def build_connector_meta(self, scheduler_output):
        meta = PdkvConnectorMetadata(reqs_to_send=self._send, reqs_to_recv=self._recv)
        now = time.monotonic()
        if self._waiting and now - self._last_renew >= self.renew_s:
            meta.reqs_to_renew = dict(self._waiting)
            self._last_renew = now
        self._send, self._recv = {}, {}
        return meta

    def request_finished(self, request, block_ids):
        rid = request.request_id
        params = request.kv_transfer_params
        self._waiting.pop(rid, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # aborted before its transfer: with complete params, prefill is
            # told at once to free its blocks (with incomplete ones it cannot
            # be reached, and its lease frees them)
            if not _params_missing(params):
                self._recv[rid] = RecvReq([], dict(params), notify_only=True)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None
        token = secrets.token_hex(16)
        blocks = [int(b) for b in block_ids]
        self._send[rid] = (blocks, token)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": blocks, "remote_engine_id": self.engine_id,
            "remote_host": self.host, "remote_port": self.base_port,
            "remote_request_id": rid, "tp_size": self.tp_size, "remote_kv_token": token,
        }

    def update_connector_output(self, connector_output):
        return

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        # Heterogeneous TP reads a slice of heads from each block: heads must
        # be the block's outer dimension (HND), as NIXL requires for head
        # splitting (docs/features/nixl_connector_compatibility.md).
        if getattr(vllm_config.model_config, "use_mla", False):
            return None
        return "HND"

    # --------------------------------------------------------- worker side --
    def register_kv_caches(self, kv_caches):
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        self.worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        return

    def get_finished(self, finished_req_ids):
        return self.worker.finished()

    def get_block_ids_with_load_errors(self):
        return self.worker.load_errors()

    def shutdown(self):
        if self.role == KVConnectorRole.WORKER:
            self.worker.close()


def _region_of(t):
    """(base, length, num_blocks, block_bytes, heads_outer) of a tensor whose
    dim 0 counts blocks; raises ValueError if a block is not one dense run."""
    elem = t.element_size()
    nb = t.shape[0]
    span = 1 + sum((t.shape[i] - 1) * t.stride(i) for i in range(1, t.dim()))
    if t.stride(0) != span or any(s <= 0 for s in t.stride()):
        raise ValueError(f"KV tensor {tuple(t.shape)} strides {t.stride()}: a block is not "
                         "one contiguous run")
    return t.data_ptr(), nb * span * elem, nb, span * elem


class _Worker:
    """Worker half: one agent per TP rank, driven by its progress thread."""

    def __init__(self, conn):
        self.c = conn
        self.rank = int(get_tensor_model_parallel_rank())
        self.agent = None
        self.mu = threading.Lock()
        self.done_send, self.done_recv, self.invalid = set(), set(), set()
        self.xfers = {}      # xfer_id -> request id
        self.loading = {}    # request id -> [fetches left, failed, local blocks]
        self.published = set()
        self.hnd = True
        self.num_regions = 0

    # -- registration ---------------------------------------------------------
    def register(self, kv_caches):
        regions, nb, dtype, hd = [], None, None, None
        for name, t in kv_caches.items():
            if self.c.use_mla or t.dim() == 3:
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
                dev = p.device.index or 0 if p.is_cuda else None
                regions.append((base, length, dev))
            dtype, hd = str(t.dtype).replace("torch.", ""), t.shape[-1]
        if not regions:
            raise ValueError("no KV caches to register")
        secret = None
        path = os.environ.get(ENV_SECRET_FILE) or self.c.extra.get("secret_file")
        if path:
            with open(path, "rb") as f:
                secret = f.read().rstrip(b"\r\n")
        tag = (f"pdkv1/{'mla' if self.c.use_mla else 'kv'}/{dtype}/{len(kv_caches)}L/"
               f"{len(regions)}R/h{hd}/bs{self.c.block_size}/{'HND' if self.hnd else 'NHD'}")
        self.agent = kvc.Agent(self.c.engine_id, listen_host=self.c.host,
                               listen_port=self.c.base_port + self.rank,
                               tp_size=self.c.tp_size, layout_tag=tag, secret=secret,
                               lease_ms=self.c.lease_ms,
                               expiry_ms=self.c.extra.get("expiry_ms"),
                               xfer_timeout_ms=self.c.extra.get("xfer_timeout_ms"),
                               connect_timeout_ms=self.c.extra.get("connect_timeout_ms"))
        self.agent.register_regions(nb, regions)
        self.num_regions = len(regions)
        self.cuda = regions[0][2] is not None
        self.agent.start(self._on_event)
        logger.info("pdkv rank %d: %d regions x %d blocks, side channel %s:%d, library %s",
                    self.rank, len(regions), nb, self.c.host, self.agent.port, kvc.library_path())

    # -- events (progress thread) ---------------------------------------------
    def _on_event(self, ev):
        with self.mu:
            if ev.type in (kvc.EV_RELEASED, kvc.EV_EXPIRED):
                if ev.request_id in self.published:
                    self.published.discard(ev.request_id)
                    self.done_send.add(ev.request_id)
                if ev.type == kvc.EV_EXPIRED:
                    logger.warning("pdkv: publication %s expired: %s", ev.request_id, ev.message)
                return
            if ev.type not in (kvc.EV_FETCH_DONE, kvc.EV_FETCH_FAILED):
                return
            rid = self.xfers.pop(ev.xfer_id, None)
            if rid is None or rid not in self.loading:
                return
            st = self.loading[rid]
            if ev.type == kvc.EV_FETCH_FAILED:
                st[1] = True
                logger.warning("pdkv: load of %s failed: %s %s", rid, kvc.status_str(ev.status),
                               ev.message)
            st[0] -= 1
            if st[0] == 0:
                self._finish_load(rid)

    def _finish_load(self, rid):  # self.mu held
        left, failed, local, notify_only = self.loading.pop(rid)
        if notify_only:
            return
        if failed:
            self.invalid.update(local)
        self.done_recv.add(rid)

    # -- per step ------------------------------------------------------------
    def _plan(self, params):
        """[(remote_rank, parts or None, read)] for this rank; read=False: an
        MLA replica that rank 0's read already covers: a fetch without
        blocks releases it (with wait_ms the producer holds that release if
        it comes before the publication)."""
        d, p, r = self.c.tp_size, int(params.get("tp_size", 1) or 1), self.rank
        if d >= p:
            if d % p:
                raise ValueError(f"decode TP {d} not a multiple of prefill TP {p}")
            k = d // p
            if self.c.use_mla or k == 1:
                return [(r // k, None, True)]
            if not self.hnd:
                raise ValueError("heterogeneous TP needs the HND KV-cache layout")
            return [(r // k, (k, r % k, 1, 0), True)]
        if p % d:
            raise ValueError(f"prefill TP {p} not a multiple of decode TP {d}")
        k = p // d
        if self.c.use_mla:
            return [(r * k + j, None, j == 0) for j in range(k)]
        if not self.hnd:
            raise ValueError("heterogeneous TP needs the HND KV-cache layout")
        return [(r * k + j, (1, 0, k, j), True) for j in range(k)]

    def start(self, meta):
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
                for rank, _parts, _read in self._plan(params):
                    self.agent.lease_renew(params, remote_rank=rank)
            except (kvc.KvcError, ValueError) as e:
                logger.warning("pdkv: lease renewal of %s: %s", rid, e)

    def _load(self, rid, rr, stream):
        try:
            plan = self._plan(rr.params)
        except ValueError as e:
            logger.error("pdkv: load of %s refused: %s", rid, e)
            plan = None
        with self.mu:  # one count held by this call until every fetch is started
            self.loading[rid] = [1, plan is None, list(rr.local_block_ids), rr.notify_only]
        for rank, parts, read in plan or []:
            local = rr.local_block_ids if read and not rr.notify_only else []
            try:
                with self.mu:  # the event may come before fetch() returns
                    xid = self.agent.fetch(rr.params, local, cuda_stream=stream, remote_rank=rank,
                                           parts=parts, wait_ms=self.c.wait_ms)
                    self.xfers[xid] = rid
                    self.loading[rid][0] += 1
            except kvc.KvcError as e:
                logger.error("pdkv: load of %s from rank %d: %s", rid, rank, e)
                with self.mu:
                    self.loading[rid][1] = True
        with self.mu:
            self.loading[rid][0] -= 1
            if self.loading[rid][0] == 0:
                self._finish_load(rid)

    def finished(self):
        with self.mu:
            s, r = self.done_send, self.done_recv
            self.done_send, self.done_recv = set(), set()
        return (s or None), (r or None)

    def load_errors(self):
        with self.mu:
            inv, self.invalid = self.invalid, set()
        return inv

    def close(self):
        if self.agent is not None:
            self.agent.close()
            self.agent = None
