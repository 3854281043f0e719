# SPDX-License-Identifier: Apache-2.0
"""KV-cache groups (vLLM's hybrid KV-cache manager) for PdkvConnector.

With the hybrid manager a model's layers fall into groups, each with its
own block table: full attention (MLA included) and sliding-window groups
are supported; a group of any other kind (Mamba/SSM state, chunked local
attention, ...) is refused at start-up with a message naming it.  All
groups share the block pool, so one block id names the same block of every
registered region and one publication carries the blocks of all groups.

Producer: a sliding-window group keeps only its last
cdiv(sliding_window, block_size) + 1 blocks, as NIXL clips them
(nixl/base_scheduler.py, get_exchange_clipped_blocks), less the null-block
padding (block 0) vLLM leaves before the window; kv_transfer_params carry
remote_block_ids per group (a plain list for one group, as before; a list of
lists for several, as NIXL sends them).

Consumer: each group's local blocks are lined up with the remote ones by
position in the prompt: the remote list ends at the prompt's last block,
the local unhashed list at the last allocated block; only the positions
both cover are read (a local prefix-cache hit shortens the local list, a
clipped window the remote one)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

__all__ = ["Groups", "UnsupportedModelError", "parse_remote"]


class UnsupportedModelError(ValueError):
    """The model has a KV-cache group pdkv cannot transfer."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Groups:
    """The transferable groups of a KVCacheConfig (one full-attention group
    when vLLM gives none, as older vLLM and the single-group path do)."""

    def __init__(self, kv_cache_config: Any, block_size: int):
        self.block_size = block_size
        self.window_blocks: List[int] = [0]      # per group; 0: keep every block
        self.select: Optional[Tuple[int, ...]] = None
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if not groups:
            return
        ids = getattr(kv_cache_config, "transfer_group_ids", None)
        if ids is not None:
            self.select = tuple(ids)
            groups = [groups[i] for i in ids]
        self.window_blocks = []
        for i, g in enumerate(groups):
            spec = g.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                bs = int(getattr(spec, "block_size", block_size))
                self.window_blocks.append(_cdiv(int(spec.sliding_window), bs) + 1)
            elif isinstance(spec, FullAttentionSpec):
                self.window_blocks.append(0)
            else:
                layers = list(getattr(g, "layer_names", []))
                raise UnsupportedModelError(
                    f"pdkv: KV-cache group {i} ({type(spec).__name__}, layers "
                    f"{', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''}) cannot be "
                    "transferred: pdkv moves full-attention and sliding-window groups only "
                    "(hybrid Mamba/SSM models are not supported)")

    @property
    def count(self) -> int:
        return len(self.window_blocks)

    def chosen(self, block_ids: Sequence[Sequence[int]]) -> List[List[int]]:
        if self.select is not None and len(block_ids) != self.count:
            block_ids = [block_ids[i] for i in self.select]
        if len(block_ids) != self.count:
            raise ValueError(f"pdkv: {len(block_ids)} KV-cache groups, expected {self.count}")
        return [list(map(int, g)) for g in block_ids]

    def clip(self, block_ids: Sequence[Sequence[int]]) -> List[List[int]]:
        """The producer's blocks to hand off, per group."""
        out = []
        for g, w in zip(self.chosen(block_ids), self.window_blocks):
            if w:
                g = g[-w:]
                while g and g[0] == 0:   # the null block: padding before the window
                    g = g[1:]
            out.append(g)
        return out

    def align(self, local_all: Sequence[Sequence[int]], local_unhashed: Sequence[Sequence[int]],
              remote: Sequence[Sequence[int]], num_tokens: int
              ) -> Tuple[List[int], List[int]]:
        """(local, remote) flat block lists to read, position by position.
        num_tokens: the prompt tokens whose KV the producer holds."""
        prompt_blocks = _cdiv(num_tokens, self.block_size)
        local_all, local_unhashed = self.chosen(local_all), self.chosen(local_unhashed)
        if len(remote) != self.count:
            raise ValueError(f"remote_block_ids has {len(remote)} KV-cache group(s), this "
                             f"engine {self.count}")
        lo_out: List[int] = []
        re_out: List[int] = []
        for alloc, unhashed, rem in zip(local_all, local_unhashed, remote):
            l0 = len(alloc) - len(unhashed)          # position of unhashed[0]
            r0 = prompt_blocks - len(rem)            # position of rem[0]
            lo, hi = max(l0, r0), min(len(alloc), prompt_blocks)
            if hi > lo:
                lo_out += unhashed[lo - l0:hi - l0]
                re_out += rem[lo - r0:hi - r0]
        return lo_out, re_out


def parse_remote(ids: Any) -> List[List[int]]:
    """remote_block_ids as groups: a list of ints is one group, a list of
    lists one per group; ValueError for anything else."""
    if not isinstance(ids, list):
        raise ValueError("remote_block_ids is not a list")
    if all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
        groups = [ids]
    elif ids and all(isinstance(g, list) for g in ids):
        groups = ids
    else:
        raise ValueError("remote_block_ids mixes block ids and groups")
    for g in groups:
        if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**63
                   for b in g):
            raise ValueError("remote_block_ids holds something that is not a block id")
    return [list(g) for g in groups]
