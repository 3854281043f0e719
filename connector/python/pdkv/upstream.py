# SPDX-License-Identifier: Apache-2.0
"""The vLLM interface pdkv is written against: recorded once, here.

VLLM_COMMIT is the vLLM commit whose KVConnectorBase_V1 (and SupportsHMA)
pdkv implements; SOURCES names every upstream file a behaviour of pdkv was
taken from, with the commit of the copy that was read (a file is quoted at
the commit where it last changed before it was read, so those differ).
Nothing else in the repository restates a commit by hand: the README, the
docs page, the connector and the tests take it from here, and
tests/plugin/test_plugin_drift.py fails when a file names another.

MEMBERS is every public member of KVConnectorBase_V1 at VLLM_COMMIT (plus
SupportsHMA's one method and the private accessor pdkv calls), with its
kind and parameter list; POLICY says for each whether PdkvConnector
implements it or deliberately inherits the base class's default, and why.
The drift test checks that the stand-ins (tests/plugin/standins) define
exactly MEMBERS, that POLICY covers every member, and that PdkvConnector
overrides exactly the members POLICY says it implements.

To move to a newer vLLM: in an environment where that vLLM is installed, run

    python3 -m pdkv.upstream

which prints the installed base class's members in this format and every
difference from MEMBERS.  Copy the new table here with the new commit,
classify each new or changed member in POLICY, update the stand-ins, and
the drift test tells what is still missing.
"""
from __future__ import annotations

import inspect
import sys
from typing import Dict, List, Tuple

__all__ = ["VLLM_COMMIT", "VLLM_VERSION_NOTE", "SOURCES", "MEMBERS", "POLICY", "describe",
           "members_of", "diff"]

VLLM_COMMIT = "00f4240ee6458263d76cf51ca7901ce1350bb4d1"
VLLM_VERSION_NOTE = ("vLLM main after v0.30.0 (its KVConnectorBase_V1 has "
                     "get_transfer_results and failed_recving)")

# path -> commit of the copy read; what was taken from it.
SOURCES: Dict[str, Tuple[str, str]] = {
    "vllm/distributed/kv_transfer/kv_connector/v1/base.py": (
        VLLM_COMMIT, "KVConnectorBase_V1, SupportsHMA, KVConnectorTransferResults: MEMBERS"),
    "vllm/v1/worker/kv_connector_model_runner_mixin.py": (
        VLLM_COMMIT, "_get_kv_connector_output: get_transfer_results (finished_sending, "
        "finished_recving, failed_recving), get_block_ids_with_load_errors, "
        "get_kv_connector_stats once per step, after the forward for async loads"),
    "vllm/v1/core/sched/scheduler.py": (
        VLLM_COMMIT, "_connector_finished (request_finished_all_groups for SupportsHMA, "
        "after remove_skipped_blocks), _handle_failed_recving (fail: FINISHED_ERROR, "
        "recompute: from token 0), _handle_invalid_blocks (refused with several KV-cache "
        "groups), stats: kv_connector_stats.to_dict()"),
    "vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py": (
        "0050936b22adda2ef0197fa3bb2551fe6c5437dc",
        "request_finished hands off on FINISHED_LENGTH_CAPPED and FINISHED_STOPPED; "
        "remote_block_ids per KV-cache group, clipped; prompt_token_ids may be None"),
    "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py": (
        "0050936b22adda2ef0197fa3bb2551fe6c5437dc",
        "side_channel_port + parallel_config.data_parallel_index; sliding-window groups "
        "keep their last cdiv(sliding_window, block_size) + 1 blocks "
        "(get_exchange_clipped_blocks)"),
    "vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py": (
        "bd33ba3ea6d0202d5d6fe7e21c9b1d36374fc638",
        "NixlKVConnectorStats / NixlPromMetrics: what vllm:nixl_* shows"),
    "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py": (
        "578b601cd1f41074873532e99af8369bf75cb5a9",
        "KVConnectorStats (data dict, aggregate, reduce, is_empty), KVConnectorPromMetrics "
        "(metric_types, labelnames, per_engine_labelvalues)"),
    "vllm/distributed/kv_transfer/kv_connector/factory.py": (
        "a4cd9d0d28bdb41db8dfe0acdafac2bf2f608630",
        "create_connector refuses a connector without SupportsHMA when the hybrid KV-cache "
        "manager is on"),
    "vllm/config/parallel.py": (
        "840e7972c6ab74061696e81e17d8a74db2aefd7e",
        "data_parallel_index: the DP rank, not reset to 0 for dense models"),
}

# name -> (kind, parameters, abstract).  kind: method, classmethod, property.
# Parameters as inspect.signature prints them without annotations.
MEMBERS: Dict[str, Tuple[str, str, bool]] = {
    "supports_divergent_local_hybrid_hits": ("property", "", False),
    "requires_kv_delivery": ("property", "", False),
    "__init__": ("method", "(self, vllm_config, role, kv_cache_config)", False),
    "role": ("property", "", False),
    "get_mem_pool_context": ("method", "(self)", False),
    "bind_connector_metadata": ("method", "(self, connector_metadata)", False),
    "clear_connector_metadata": ("method", "(self)", False),
    "_get_connector_metadata": ("method", "(self)", False),
    "has_connector_metadata": ("method", "(self)", False),
    "register_kv_caches": ("method", "(self, kv_caches)", False),
    "set_host_xfer_buffer_ops": ("method", "(self, copy_operation)", False),
    "finish_forward": ("method", "(self)", False),
    "reset_capture_state": ("method", "(self)", False),
    "handle_preemptions": ("method", "(self, kv_connector_metadata)", False),
    "start_load_kv": ("method", "(self, forward_context, **kwargs)", True),
    "wait_for_layer_load": ("method", "(self, layer_name)", True),
    "save_kv_layer": ("method", "(self, layer_name, kv_layer, attn_metadata, **kwargs)", True),
    "wait_for_save": ("method", "(self)", True),
    "get_finished": ("method", "(self, finished_req_ids)", False),
    "get_transfer_results": ("method", "(self, finished_req_ids)", False),
    "get_block_ids_with_load_errors": ("method", "(self)", False),
    "shutdown": ("method", "(self)", False),
    "get_kv_connector_stats": ("method", "(self)", False),
    "get_kv_connector_kv_cache_events": ("method", "(self)", False),
    "get_handshake_metadata": ("method", "(self)", False),
    "build_connector_worker_meta": ("method", "(self)", False),
    "bind_kv_cache_manager": ("method", "(self, kv_cache_manager)", False),
    "bind_gpu_block_pool": ("method", "(self, gpu_block_pool)", False),
    "get_num_new_matched_tokens": ("method", "(self, request, num_computed_tokens)", True),
    "update_state_after_alloc": ("method", "(self, request, blocks, num_external_tokens)", True),
    "build_connector_meta": ("method", "(self, scheduler_output)", True),
    "on_new_request": ("method", "(self, request)", False),
    "update_connector_output": ("method", "(self, connector_output)", False),
    "can_load_prefix_replay_checkpoint": (
        "method", "(self, request, num_local_tokens, num_external_tokens)", False),
    "consume_prefix_replay_checkpoint": ("method", "(self, request, num_hit_tokens)", False),
    "request_finished": ("method", "(self, request, block_ids)", False),
    "register_finished_partial_tail": (
        "method", "(self, request, block_ids, partial_tail_offloads)", False),
    "take_events": ("method", "(self)", False),
    "has_pending_block_frees": ("method", "(self)", False),
    "has_pending_push_work": ("method", "(self)", False),
    "get_required_kvcache_layout": ("classmethod", "(vllm_config)", False),
    "requires_piecewise_for_cudagraph": ("classmethod", "(extra_config)", False),
    "get_finished_count": ("method", "(self)", False),
    "build_kv_connector_stats": ("classmethod", "(data=None)", False),
    "set_xfer_handshake_metadata": ("method", "(self, metadata)", False),
    "set_xfer_handshake_metadata_pp_aware": ("method", "(self, metadata)", False),
    "build_prom_metrics": (
        "classmethod", "(vllm_config, metric_types, labelnames, per_engine_labelvalues)", False),
    "reset_cache": ("method", "(self)", False),
}
# SupportsHMA (same module): the one method a hybrid-capable connector adds.
HMA_MEMBERS: Dict[str, Tuple[str, str, bool]] = {
    "request_finished_all_groups": ("method", "(self, request, block_ids)", True),
}
# KVConnectorTransferResults (same module), what get_transfer_results returns.
TRANSFER_RESULTS_FIELDS: List[str] = ["finished_sending", "finished_recving", "failed_recving",
                                      "prefix_replay_checkpoints"]

IMPLEMENTED = "implemented"
# name -> IMPLEMENTED, or why the base class's default is right for pdkv.
POLICY: Dict[str, str] = {
    "supports_divergent_local_hybrid_hits": "False: pdkv restores no recurrent state",
    "requires_kv_delivery": "producer role: a preempted prefill whose hand-off is pending "
                            "is recomputed, as pdkv's blocks must not be freed under a read",
    "__init__": IMPLEMENTED,
    "role": "the base class keeps the role",
    "get_mem_pool_context": "vLLM's own pool: pdkv registers the tensors vLLM allocates",
    "bind_connector_metadata": "the base class keeps the step's metadata",
    "clear_connector_metadata": "the base class keeps the step's metadata",
    "_get_connector_metadata": "the base class keeps the step's metadata",
    "has_connector_metadata": "the base class keeps the step's metadata",
    "register_kv_caches": IMPLEMENTED,
    "set_host_xfer_buffer_ops": "libkvconnector stages CUDA memory itself; no vLLM host buffer",
    "finish_forward": "loads write blocks the forward pass does not read until "
                      "finished_recving; nothing to fence",
    "reset_capture_state": "nothing of pdkv runs inside CUDA graphs",
    "handle_preemptions": "no asynchronous saves to protect",
    "start_load_kv": IMPLEMENTED,
    "wait_for_layer_load": IMPLEMENTED,
    "save_kv_layer": IMPLEMENTED,
    "wait_for_save": IMPLEMENTED,
    "get_finished": IMPLEMENTED,
    "get_transfer_results": IMPLEMENTED,
    "get_block_ids_with_load_errors": IMPLEMENTED,
    "shutdown": IMPLEMENTED,
    "get_kv_connector_stats": IMPLEMENTED,
    "get_kv_connector_kv_cache_events": "pdkv emits no KV-cache events",
    "get_handshake_metadata": "libkvconnector handshakes on its own side channel per worker",
    "build_connector_worker_meta": "workers report through get_transfer_results only",
    "bind_kv_cache_manager": "pdkv does not touch the cache manager",
    "bind_gpu_block_pool": "pdkv does not touch the block pool",
    "get_num_new_matched_tokens": IMPLEMENTED,
    "update_state_after_alloc": IMPLEMENTED,
    "build_connector_meta": IMPLEMENTED,
    "on_new_request": "leases are renewed for requests get_num_new_matched_tokens saw",
    "update_connector_output": IMPLEMENTED,
    "can_load_prefix_replay_checkpoint": "False: no replay checkpoints",
    "consume_prefix_replay_checkpoint": "False: no replay checkpoints",
    "request_finished": IMPLEMENTED,
    "request_finished_all_groups": IMPLEMENTED,
    "register_finished_partial_tail": "False: no partial-tail offloads",
    "take_events": "pdkv emits no KV-cache events",
    "has_pending_block_frees": "False: a hand-off's blocks come back when decode reads them "
                               "or the lease ends, not soon enough to wait for",
    "has_pending_push_work": "False: pdkv's decode pulls",
    "get_required_kvcache_layout": IMPLEMENTED,
    "requires_piecewise_for_cudagraph": "False: no layer-wise operations",
    "get_finished_count": "None: every TP worker reports each request",
    "build_kv_connector_stats": IMPLEMENTED,
    "set_xfer_handshake_metadata": "no handshake metadata through vLLM",
    "set_xfer_handshake_metadata_pp_aware": "the default refuses pipeline parallelism "
                                            "(pp_rank > 0), which pdkv does not support",
    "build_prom_metrics": IMPLEMENTED,
    "reset_cache": "pdkv keeps no cache",
}


def describe(obj) -> Tuple[str, str, bool]:
    """(kind, parameters, abstract) of a class attribute, in MEMBERS' format."""
    abstract = bool(getattr(obj, "__isabstractmethod__", False))
    if isinstance(obj, property):
        return "property", "", abstract
    if isinstance(obj, classmethod):
        fn = obj.__func__
        params = list(inspect.signature(fn).parameters.values())[1:]
        return "classmethod", _params(params), abstract
    if isinstance(obj, staticmethod):
        return "staticmethod", _params(inspect.signature(obj.__func__).parameters.values()), \
            abstract
    return "method", _params(inspect.signature(obj).parameters.values()), abstract


def _params(params) -> str:
    out = []
    for p in params:
        text = p.name
        if p.kind == p.VAR_POSITIONAL:
            text = "*" + text
        elif p.kind == p.VAR_KEYWORD:
            text = "**" + text
        if p.default is not p.empty:
            text += "=" + repr(p.default)
        out.append(text)
    return "(" + ", ".join(out) + ")"


def members_of(cls, include=("_get_connector_metadata",)) -> Dict[str, Tuple[str, str, bool]]:
    """Public members (and `include`) defined by cls itself, described."""
    return {name: describe(obj) for name, obj in vars(cls).items()
            if (not name.startswith("_") or name == "__init__" or name in include)
            and (callable(obj) or isinstance(obj, (property, classmethod, staticmethod)))}


def diff(found: Dict[str, Tuple[str, str, bool]],
         recorded: Dict[str, Tuple[str, str, bool]]) -> List[str]:
    """Lines naming every member added, removed or changed from recorded."""
    out = []
    for name in sorted(set(found) | set(recorded)):
        if name not in recorded:
            out.append(f"added upstream: {name} {found[name]}")
        elif name not in found:
            out.append(f"removed upstream: {name}")
        elif found[name] != recorded[name]:
            out.append(f"changed upstream: {name} {recorded[name]} -> {found[name]}")
    return out


def main() -> int:
    """Prints the installed vLLM's base-class members and their drift."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    found = members_of(base.KVConnectorBase_V1)
    for name, desc in found.items():
        print(f"    {name!r}: {desc!r},")
    found_hma = members_of(base.SupportsHMA) if hasattr(base, "SupportsHMA") else {}
    lines = diff(found, MEMBERS) + diff(found_hma, HMA_MEMBERS)
    print("\n".join(lines) or "no drift from the recorded members")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
