# SPDX-License-Identifier: Apache-2.0
"""PdkvConnector: libkvconnector as a vLLM V1 KV connector (KVConnectorBase_V1,
SupportsHMA).

Load it with
  --kv-transfer-config '{"kv_connector":"PdkvConnector",
                         "kv_connector_module_path":"pdkv.connector",
                         "kv_role":"kv_both"}'

Written against the vLLM commit recorded in pdkv/upstream.py (VLLM_COMMIT),
whose member list says what is implemented here and what is inherited on
purpose.  The flow follows the pull model of vLLM's NIXL connector:

  prefill (request with kv_transfer_params.do_remote_decode): when it finishes
  by length cap or by a stop (its one token was EOS or a stop string),
  request_finished[_all_groups]() keeps its blocks (per KV-cache group,
  sliding-window groups clipped to the window: pdkv/groups.py), mints the
  publication's token and returns kv_transfer_params (do_remote_prefill,
  remote_block_ids, remote_engine_id, remote_host, remote_port,
  remote_request_id, tp_size, remote_kv_token, remote_num_tokens,
  transfer_mode "pull"); the next step's metadata tells every worker to
  publish the blocks with that token.  The blocks return to vLLM
  (finished_sending) once decode notified or the publication expired.

  decode (request with do_remote_prefill): get_num_new_matched_tokens reports
  the prompt tokens not computed locally as loaded asynchronously (for
  prompt embeddings too: num_prompt_tokens, not prompt_token_ids);
  update_state_after_alloc lines the allocated blocks up with the remote ones
  and checks remote_host / remote_port (pdkv/config.py: types, ranges,
  allowed producer networks); the workers fetch (registered at the producer
  even before it publishes) and report the request in finished_recving; a
  failed load also in failed_recving (get_transfer_results), where vLLM
  applies kv_load_failure_policy (fail / recompute).  Refused params take
  that same path without connecting anywhere, so a client learns nothing
  from the outcome about the address it named.

Workers' transfer figures reach vLLM's /metrics as vllm:pdkv_* (pdkv/stats.py).
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus

from pdkv import upstream
from pdkv.config import ParamsError, Settings, check_remote
from pdkv.groups import Groups, parse_remote
from pdkv.stats import PdkvKVConnectorStats, PdkvPromMetrics

__all__ = ["PdkvConnector", "PdkvConnectorMetadata", "RecvReq"]

logger = logging.getLogger("pdkv.connector")

REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
            "remote_port", "remote_kv_token")
HAND_OFF = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclasses.dataclass
class RecvReq:
    """One load for the workers: flat local and remote block lists, lined up."""
    local_block_ids: List[int]
    remote_block_ids: List[int]
    params: Dict[str, Any]
    awaiting: bool = True            # the request waits for finished_recving
    refused: Optional[str] = None    # why nothing may connect (the load fails)


@dataclasses.dataclass
class PdkvConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one step: what to publish, fetch, notify, renew."""
    reqs_to_send: Dict[str, Tuple[List[int], str]] = dataclasses.field(default_factory=dict)
    reqs_to_recv: Dict[str, RecvReq] = dataclasses.field(default_factory=dict)
    reqs_to_renew: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)


def _params_missing(params: Dict[str, Any]) -> List[str]:
    """The required kv_transfer_params keys that are absent or empty ([]: the
    params are complete)."""
    return [k for k in REQUIRED if params.get(k) in (None, "", [])]


def _num_prompt_tokens(request: Any) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    if n is None:
        n = len(request.prompt_token_ids or ())
    return int(n)


class PdkvConnector(KVConnectorBase_V1, SupportsHMA):

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = Settings.from_vllm(vllm_config)
        s = self.settings
        self.groups = Groups(kv_cache_config, s.block_size)
        self.engine_id, self.tp_size = s.engine_id, s.tp_size
        self.host, self.base_port = s.host, s.base_port
        if role == KVConnectorRole.SCHEDULER:
            self._send: Dict[str, Tuple[List[int], str]] = {}
            self._recv: Dict[str, RecvReq] = {}
            self._waiting: Dict[str, Dict[str, Any]] = {}  # queued decode requests: renew
            self._last_renew = time.monotonic()
            logger.info("pdkv scheduler %s: side channel %s:%d, %d KV-cache group(s), written "
                        "for vLLM %s", s.engine_id, s.host, s.base_port, self.groups.count,
                        upstream.VLLM_COMMIT[:12])
        else:
            from pdkv.worker import Worker
            self.worker = Worker(s, self.groups.count)

    # ------------------------------------------------------ scheduler side --
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or _params_missing(params):
            return 0, False
        count = _num_prompt_tokens(request) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._waiting[request.request_id] = params
        return count, True

    def _refusal(self, params: Dict[str, Any]) -> Optional[str]:
        try:
            tp = params.get("tp_size", 1)
            ranks = tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 0 else 1
            check_remote(params, self.settings.networks, ranks)
            if not isinstance(params.get("remote_kv_token"), str):
                raise ParamsError("remote_kv_token is not a string")
        except ParamsError as e:
            return str(e)
        return None

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        rid = request.request_id
        self._waiting.pop(rid, None)
        missing = _params_missing(params)
        if missing:
            logger.warning("request %s: invalid kv_transfer_params, missing %s: prefill "
                           "recomputed", rid, ",".join(missing))
            params["do_remote_prefill"] = False
            return
        refused = self._refusal(params)
        local: List[int] = []
        remote: List[int] = []
        if refused is None and num_external_tokens > 0:
            try:
                groups = parse_remote(params["remote_block_ids"])
                if hasattr(blocks, "get_unhashed_block_ids_all_groups"):
                    unhashed = blocks.get_unhashed_block_ids_all_groups()
                else:
                    unhashed = [blocks.get_unhashed_block_ids()]
                n = params.get("remote_num_tokens")
                ntok = _num_prompt_tokens(request)
                if isinstance(n, int) and not isinstance(n, bool) and 0 < n < ntok:
                    ntok = n
                local, remote = self.groups.align(blocks.get_block_ids(), unhashed, groups,
                                                  ntok)
            except ValueError as e:
                refused = str(e)
        if refused is not None:
            logger.warning("request %s: kv_transfer_params refused (%s): the load fails, "
                           "kv_load_failure_policy applies", rid, refused)
        self._recv[rid] = RecvReq(local, remote, dict(params), awaiting=num_external_tokens > 0,
                                  refused=refused)
        params["do_remote_prefill"] = False  # second call after the load: nothing to do

    def build_connector_meta(self, scheduler_output: Any) -> PdkvConnectorMetadata:
        meta = PdkvConnectorMetadata(reqs_to_send=self._send, reqs_to_recv=self._recv)
        now = time.monotonic()
        if self._waiting and now - self._last_renew >= self.settings.renew_s:
            meta.reqs_to_renew = {r: p for r, p in self._waiting.items()
                                  if self._refusal(p) is None}
            self._last_renew = now
        self._send, self._recv = {}, {}
        return meta

    def request_finished(self, request: Any, block_ids: List[int]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: Tuple[List[int], ...]
                                    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._finished(request, block_ids)

    def _finished(self, request: Any, block_ids: Sequence[Sequence[int]]
                  ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        rid = request.request_id
        params = request.kv_transfer_params
        self._waiting.pop(rid, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # aborted before its transfer: with complete, acceptable params
            # prefill is told at once to free its blocks (otherwise it
            # cannot, or may not, be reached, and its lease frees them)
            if not _params_missing(params) and self._refusal(params) is None:
                self._recv[rid] = RecvReq([], [], dict(params), awaiting=False)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode") or request.status not in HAND_OFF:
            return False, None
        groups = self.groups.clip(block_ids)
        blocks = [b for g in groups for b in g]
        if not blocks:
            return False, None
        token = secrets.token_hex(16)
        self._send[rid] = (blocks, token)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": groups[0] if len(groups) == 1 else groups,
            "remote_engine_id": self.engine_id, "remote_host": self.host,
            "remote_port": self.base_port, "remote_request_id": rid, "tp_size": self.tp_size,
            "remote_kv_token": token,
            "remote_num_tokens": int(getattr(request, "num_computed_tokens", 0) or 0),
            "transfer_mode": "pull",
        }

    def update_connector_output(self, connector_output: Any) -> None:
        return

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        # Heterogeneous TP reads a slice of heads from each block: heads must
        # be the block's outer dimension (HND), as NIXL requires for head
        # splitting (docs/features/nixl_connector_compatibility.md).
        if getattr(vllm_config.model_config, "use_mla", False):
            return None
        return "HND"

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                 ) -> PdkvKVConnectorStats:
        return PdkvKVConnectorStats(data=data) if data is not None else PdkvKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: List[str],
                           per_engine_labelvalues: Dict[int, List[object]]) -> PdkvPromMetrics:
        return PdkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --------------------------------------------------------- worker side --
    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: Set[str]
                     ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        r = self.worker.results()
        return (r.finished_sending or None), (r.finished_recving or None)

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        return self.worker.results()

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self.worker.load_errors()

    def get_kv_connector_stats(self) -> Optional[PdkvKVConnectorStats]:
        if self.role != KVConnectorRole.WORKER:
            return None
        return self.worker.take_stats()

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self.worker.close()
