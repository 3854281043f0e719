# SPDX-License-Identifier: Apache-2.0
"""Stand-in for vllm/v1/kv_cache_interface.py: the spec classes a KV-cache
group can have (the subset the driver builds: full attention, sliding
window, a Mamba state) and KVCacheConfig's kv_cache_groups."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclasses.dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int = 1
    head_size: int = 1


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    pass


@dataclasses.dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 0


@dataclasses.dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    num_speculative_blocks: int = 0


@dataclasses.dataclass
class KVCacheGroupSpec:
    layer_names: list
    kv_cache_spec: KVCacheSpec


@dataclasses.dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list
