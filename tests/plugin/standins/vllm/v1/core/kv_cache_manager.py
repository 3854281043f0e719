# SPDX-License-Identifier: Apache-2.0
"""Stand-in for vllm/v1/core/kv_cache_manager.py's KVCacheBlocks: the block
ids allocated to a request, one KV-cache group; get_unhashed_block_ids()
lists those not taken from the prefix cache (all of them here: the driver
runs without prefix caching unless a test marks a prefix as hashed)."""


class KVCacheBlocks:
    __slots__ = ("_ids", "_hashed")

    def __init__(self, block_ids, num_hashed=0):
        self._ids = list(block_ids)
        self._hashed = int(num_hashed)

    def get_block_ids(self):
        return (list(self._ids),)

    def get_unhashed_block_ids(self):
        return list(self._ids[self._hashed:])
