"""Eviction policies: which free block of a region the pool reuses next.

A free block with a hash is a cached prefix block; reusing it is an *eviction*. The pool keeps
free blocks in an intrusive queue (``block_pool.FreeBlockQueue``) in the order they were freed;
the policy picks the victim among the linked blocks:

* ``lru`` (default): the queue's head, the block freed longest ago (O(1)).
* ``lfu``: the block with the fewest *uses*; among equals, the one freed longest ago. A block
  without a hash (nothing to lose) goes before any cached block. A use is the allocation that
  filled the block plus every reference later taken on it (a prefix hit, a session hold, a
  pin); the count restarts when the block is reused for other contents. O(log n) per pick
  with a heap of (uncached first, uses, free order) whose stale entries are skipped lazily
  and compacted when they outnumber the free blocks.

The host tier (``host_pool.py``) keeps its own LRU; these policies order the device blocks.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block_pool import FreeBlockQueue, KVCacheBlock

EVICTION_POLICIES = ("lru", "lfu")


class LRUPolicy:
    """Reuse the block freed longest ago."""

    name = "lru"

    def on_free(self, block: KVCacheBlock, queue: FreeBlockQueue) -> None:
        """``block`` was just linked at ``queue``'s tail (or its hash changed while linked)."""

    def on_use(self, block: KVCacheBlock) -> None:
        """A reference was taken on ``block`` (allocation or hit)."""

    def victim(self, queue: FreeBlockQueue) -> KVCacheBlock:
        """The next block to reuse; it stays linked (the pool unlinks it)."""
        block = queue.head.next
        if block is queue.tail:
            raise IndexError("free queue is empty")
        return block


class LFUPolicy(LRUPolicy):
    """Reuse the least used block (uncached ones first; ties: freed longest ago)."""

    name = "lfu"

    def __init__(self) -> None:
        self._heaps: dict[int, list] = {}          # id(queue) -> [(uncached?0:1, uses, stamp, id, block)]
        self._stamp = itertools.count()
        self._stamps: dict[int, int] = {}          # block id -> stamp of its live heap entry

    def on_free(self, block: KVCacheBlock, queue: FreeBlockQueue) -> None:
        heap = self._heaps.setdefault(id(queue), [])
        stamp = next(self._stamp)
        self._stamps[block.block_id] = stamp
        heapq.heappush(heap, (block.block_hash is not None, block.uses, stamp, block.block_id, block))
        if len(heap) > 4 * queue.num_free + 64:
            self._compact(queue, heap)

    def on_use(self, block: KVCacheBlock) -> None:
        block.uses += 1

    def victim(self, queue: FreeBlockQueue) -> KVCacheBlock:
        heap = self._heaps.get(id(queue), [])
        while heap:
            cached, uses, stamp, _, block = heap[0]
            if (block.prev is not None and self._stamps.get(block.block_id) == stamp
                    and cached == (block.block_hash is not None) and uses == block.uses):
                return block
            heapq.heappop(heap)                    # stale: unlinked, re-freed or changed since
        raise IndexError("free queue is empty")

    def _compact(self, queue: FreeBlockQueue, heap: list) -> None:
        live = [e for e in heap if e[4].prev is not None and self._stamps.get(e[3]) == e[2]]
        heapq.heapify(live)
        heap[:] = live


def make_eviction_policy(name: str) -> LRUPolicy:
    """The policy named ``name`` (``lru`` or ``lfu``). Raises ValueError otherwise."""
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {name!r}")
