"""The host KV tier: a bounded pool of KV block copies in host memory.

Every host slot is in exactly one of three states::

    free     in ``free`` only
    cached   in ``cached`` (block hash -> slot, LRU order: first = dropped first)
    owned    held by a swapped-out request (``take_owned`` .. ``release_owned``)

A cached slot may also be *locked* (a host -> device copy of it is pending this step): locked
slots are never dropped, so a copy never reads a slot that was reused meanwhile. Storage is one
tensor ``[slots, layers, 2 (K|V), block_size, Hkv, D]`` in the cache dtype (pinned memory on
CUDA), so one block's K/V for all layers is contiguous and moves in one copy.

Events: a hash that becomes cached here is a "stored" event of tier ``host``; one dropped by the
LRU is a "removed" event. The pool does no copying itself; see :mod:`kv_transfer`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NewType

import torch

from .block_pool import KVEventLog
from .hashing import BlockHash

HostSlot = NewType("HostSlot", int)


class HostKVPool:
    """Host-memory copies of KV blocks, keyed by block hash (LRU) or owned by a swap.

    Args:
        num_slots: blocks the pool holds (> 0).
        block_shape: ``(layers, 2, block_size, Hkv, D)`` of one block.
        dtype: the KV cache dtype.
        pin_memory: allocate page-locked memory (for async copies to/from CUDA).
    """

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool = False) -> None:
        if num_slots <= 0:
            raise ValueError(f"host_kv_blocks must be positive to create a host tier, got {num_slots}")
        self.data = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.num_slots = num_slots
        self.free: list[HostSlot] = [HostSlot(i) for i in reversed(range(num_slots))]
        self.cached: OrderedDict[BlockHash, HostSlot] = OrderedDict()
        self.slot_hash: dict[HostSlot, BlockHash] = {}
        self.locks: dict[HostSlot, int] = {}
        self.num_owned = 0
        self.events = KVEventLog()
        self.num_dropped = 0

    # ---- cached (hash-keyed) slots ------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> HostSlot | None:
        """The slot holding ``block_hash``, or None. Does not change the LRU order."""
        return self.cached.get(block_hash)

    def reserve(self, block_hash: BlockHash) -> HostSlot | None:
        """A slot to copy the block ``block_hash`` into, or None when no copy is needed
        (already held: it becomes most recently used) or no slot can be freed."""
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self.cached[block_hash] = slot
        self.slot_hash[slot] = block_hash
        self.events.stored(block_hash)
        return slot

    def lock(self, slot: HostSlot) -> None:
        """Keep ``slot`` from being dropped until ``unlock`` (a copy from it is pending)."""
        self.locks[slot] = self.locks.get(slot, 0) + 1
        block_hash = self.slot_hash.get(slot)
        if block_hash is not None:
            self.cached.move_to_end(block_hash)

    def unlock(self, slot: HostSlot) -> None:
        n = self.locks[slot] - 1
        if n:
            self.locks[slot] = n
        else:
            del self.locks[slot]

    # ---- owned (swap) slots -------------------------------------------------------------
    def take_owned(self, n: int) -> list[HostSlot] | None:
        """``n`` slots for a swap-out (dropping LRU cached blocks), or None if they don't exist."""
        if n > self.num_available():
            return None
        slots = [self._take_slot() for _ in range(n)]
        self.num_owned += n
        return slots

    def release_owned(self, slots: list[HostSlot]) -> None:
        self.free.extend(slots)
        self.num_owned -= len(slots)

    # ---- accounting ---------------------------------------------------------------------
    def num_available(self) -> int:
        """Slots a swap-out or copy could get now: free ones plus unlocked cached ones."""
        return len(self.free) + len(self.cached) - len(self.locks)

    @property
    def num_used(self) -> int:
        return len(self.cached) + self.num_owned

    def drop_all_cached(self, match=None) -> int:
        """Forget every unlocked cached slot (a cache flush), or those whose hash ``match``
        accepts; each is a "removed" event. Returns how many."""
        dropped = [(h, s) for h, s in self.cached.items()
                   if s not in self.locks and (match is None or match(h))]
        for block_hash, slot in dropped:
            del self.cached[block_hash]
            del self.slot_hash[slot]
            self.events.removed(block_hash)
            self.free.append(slot)
        return len(dropped)

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Return and clear the (stored, removed) hashes of this tier since the last call."""
        return self.events.drain()

    def check_integrity(self) -> None:
        """Assert: free + cached + owned == slots, and the two hash maps mirror each other."""
        assert len(self.free) + len(self.cached) + self.num_owned == self.num_slots, "host slot lost"
        assert len(set(self.free)) == len(self.free), "host slot freed twice"
        assert not set(self.free) & set(self.cached.values()), "host slot both free and cached"
        assert {s: h for h, s in self.cached.items()} == self.slot_hash, "host maps disagree"
        assert all(s in self.slot_hash for s in self.locks), "lock on a slot that is not cached"

    def _take_slot(self) -> HostSlot | None:
        if self.free:
            return self.free.pop()
        for block_hash, slot in self.cached.items():     # oldest first; skip locked ones
            if slot not in self.locks:
                del self.cached[block_hash]
                del self.slot_hash[slot]
                self.events.removed(block_hash)
                self.num_dropped += 1
                return slot
        return None
