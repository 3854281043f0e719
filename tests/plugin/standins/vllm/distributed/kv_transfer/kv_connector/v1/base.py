# SPDX-License-Identifier: Apache-2.0
"""Stand-in for vllm/distributed/kv_transfer/kv_connector/v1/base.py at the
vLLM commit recorded in connector/python/pdkv/upstream.py: every public
member of KVConnectorBase_V1 with the upstream parameters (the drift test
checks them against pdkv.upstream.MEMBERS), SupportsHMA, supports_hma and
KVConnectorTransferResults.  The defaults behave as upstream's do (written
from the upstream file, not copied).  Abstract methods stay abstract, so a
connector that misses one cannot be instantiated, as in vLLM."""
import dataclasses
import enum
from abc import ABC, abstractmethod


@dataclasses.dataclass
class KVConnectorTransferResults:
    finished_sending: set = dataclasses.field(default_factory=set)
    finished_recving: set = dataclasses.field(default_factory=set)
    failed_recving: set = dataclasses.field(default_factory=set)
    prefix_replay_checkpoints: dict = dataclasses.field(default_factory=dict)


class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids):
        raise NotImplementedError


def supports_hma(connector):
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    return isinstance(connector, SupportsHMA)


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorHandshakeMetadata(ABC):  # noqa: B024
    pass


class KVConnectorMetadata(ABC):  # noqa: B024
    pass


class KVConnectorBase_V1(ABC):
    @property
    def supports_divergent_local_hybrid_hits(self):
        return False

    @property
    def requires_kv_delivery(self):
        return self._kv_transfer_config.kv_role in ("kv_producer", "kv_both")

    def __init__(self, vllm_config, role, kv_cache_config):
        self._connector_metadata = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._kv_cache_manager = None
        self._role = role

    @property
    def role(self):
        return self._role

    # worker side
    def get_mem_pool_context(self):
        return None

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self):
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches):
        return

    def set_host_xfer_buffer_ops(self, copy_operation):
        return

    def finish_forward(self):
        return

    def reset_capture_state(self):
        return

    def handle_preemptions(self, kv_connector_metadata):
        return

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs):
        pass

    @abstractmethod
    def wait_for_layer_load(self, layer_name):
        pass

    @abstractmethod
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    @abstractmethod
    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids):
        return None, None

    def get_transfer_results(self, finished_req_ids):
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()))

    def get_block_ids_with_load_errors(self):
        return set()

    def shutdown(self):
        return None

    def get_kv_connector_stats(self):
        return None

    def get_kv_connector_kv_cache_events(self):
        return None

    def get_handshake_metadata(self):
        return None

    def build_connector_worker_meta(self):
        return None

    # scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager):
        self._kv_cache_manager = kv_cache_manager
        self.bind_gpu_block_pool(kv_cache_manager.block_pool)

    def bind_gpu_block_pool(self, gpu_block_pool):
        return

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        pass

    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    @abstractmethod
    def build_connector_meta(self, scheduler_output):
        pass

    def on_new_request(self, request):
        return

    def update_connector_output(self, connector_output):
        return

    def can_load_prefix_replay_checkpoint(self, request, num_local_tokens, num_external_tokens):
        return False

    def consume_prefix_replay_checkpoint(self, request, num_hit_tokens):
        return False

    def request_finished(self, request, block_ids):
        return False, None

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads):
        return False

    def take_events(self):
        return ()

    def has_pending_block_frees(self):
        return False

    def has_pending_push_work(self):
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        if cls is KVConnectorBase_V1:
            raise TypeError("get_required_kvcache_layout should not be called "
                            "on the abstract base class")
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        return False

    def get_finished_count(self):
        return None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return None

    def set_xfer_handshake_metadata(self, metadata):
        return None

    def set_xfer_handshake_metadata_pp_aware(self, metadata):
        if any(pp_rank != 0 for pp_rank, _ in metadata):
            raise ValueError(f"{type(self).__name__} received pp_rank > 0 handshake metadata "
                             "but does not support PP-disaggregated KV transfer.")
        self.set_xfer_handshake_metadata({tp: m for (_, tp), m in metadata.items()})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return None

    def reset_cache(self):
        return None
