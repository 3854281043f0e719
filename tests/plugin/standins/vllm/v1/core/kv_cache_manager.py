# SPDX-License-Identifier: Apache-2.0
"""Stand-in for vllm/v1/core/kv_cache_manager.py's KVCacheBlocks: the block
ids allocated to a request, one list per KV-cache group.
get_unhashed_block_ids_all_groups() lists, per group, those not taken from
the prefix cache and not the null block 0 (the driver runs without prefix
caching unless a test marks a prefix as hashed; sliding-window groups have
null blocks before their window); get_unhashed_block_ids() is the
one-group form (it asserts one group, as upstream)."""


class KVCacheBlocks:
    __slots__ = ("_groups", "_hashed")

    def __init__(self, block_ids, num_hashed=0):
        if block_ids and not isinstance(block_ids[0], (list, tuple)):
            block_ids = [block_ids]
        self._groups = [list(g) for g in block_ids]
        self._hashed = int(num_hashed)

    def get_block_ids(self):
        return tuple(list(g) for g in self._groups)

    def get_unhashed_block_ids(self):
        assert len(self._groups) == 1, "Only one group is supported"
        return list(self._groups[0][self._hashed:])

    def get_unhashed_block_ids_all_groups(self):
        return [[b for b in g[self._hashed:] if b != 0] for g in self._groups]
