"""Batched KV copies between the device cache and the host tier, run at step boundaries.

The scheduler only *records* copies while it plans a step; ``Engine.step`` calls ``flush``
after planning and before the model runs. Within a flush, all device -> host copies run before
all host -> device copies::

    plan:   evict b7 (hash h)      swap out b3 -> slot 9      load slot 4 -> b7 (a host hit)
    flush:  [b7 -> slot s(h), b3 -> slot 9]  then  [slot 4 -> b7]  then the forward

so a block that is reused in the same step (b7 above) is saved before it is overwritten, and
nothing writes a device block before the forward except these loads. Slots read by a load are
locked (cached) or owned (swap) until the flush, so no save can reuse them first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvharbor.kernels.reference import float8_as_bytes

from .hashing import BlockHash
from .host_pool import HostKVPool, HostSlot


class KVTransfer:
    """Pending copies of one step and the counters of all steps.

    Args:
        host: the host tier.
        caches: the device cache, one ``LayerKVCache`` per layer, ``[N, bs, Hkv, D]`` each.
    """

    def __init__(self, host: HostKVPool, caches: Sequence) -> None:
        self.host = host
        self.caches = caches
        self.evicted: list[tuple[int, BlockHash]] = []          # (device block, hash) to offload
        self.saves: list[tuple[int, HostSlot]] = []             # (device block, owned slot)
        self.loads: list[tuple[HostSlot, int]] = []             # (slot, device block)
        self.unlock_after: list[HostSlot] = []
        self.release_after: list[HostSlot] = []
        self.blocks_to_host = 0
        self.blocks_to_device = 0

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        """A cached device block was popped for reuse: offload it at the next flush."""
        self.evicted.append((block_id, block_hash))

    def save(self, block_id: int, slot: HostSlot) -> None:
        """Copy device block ``block_id`` into the owned ``slot`` at the next flush."""
        self.saves.append((block_id, slot))

    def load(self, slot: HostSlot, block_id: int, owned: bool) -> None:
        """Copy ``slot`` into device block ``block_id`` at the next flush.

        A cached slot is locked until then; an owned (swap) slot is released after it.
        """
        self.loads.append((slot, block_id))
        if owned:
            self.release_after.append(slot)
        else:
            self.host.lock(slot)
            self.unlock_after.append(slot)

    @property
    def pending(self) -> bool:
        return bool(self.evicted or self.saves or self.loads)

    def flush(self) -> None:
        """Run the recorded copies: every save, then every load; then free the slots."""
        saves = list(self.saves)
        for block_id, block_hash in self.evicted:
            slot = self.host.reserve(block_hash)
            if slot is not None:
                saves.append((block_id, slot))
        if saves:
            self._to_host([b for b, _ in saves], [s for _, s in saves])
        if self.loads:
            self._to_device([s for s, _ in self.loads], [b for _, b in self.loads])
        for slot in self.unlock_after:
            self.host.unlock(slot)
        if self.release_after:
            self.host.release_owned(self.release_after)
        self.evicted, self.saves, self.loads = [], [], []
        self.unlock_after, self.release_after = [], []

    def _to_host(self, block_ids: list[int], slots: list[int]) -> None:
        dev = self.caches[0].key.device
        ids = torch.tensor(block_ids, dtype=torch.long, device=dev)
        # [n, layers, 2, bs, Hkv, D]: gather on the device, then one copy to host memory.
        blocks = torch.stack([torch.stack((float8_as_bytes(c.key)[ids], float8_as_bytes(c.value)[ids]), 1)
                              for c in self.caches], 1)
        float8_as_bytes(self.host.data)[torch.tensor(slots, dtype=torch.long)] = blocks.cpu()
        self.blocks_to_host += len(block_ids)

    def _to_device(self, slots: list[int], block_ids: list[int]) -> None:
        dev = self.caches[0].key.device
        src = float8_as_bytes(self.host.data)[torch.tensor(slots, dtype=torch.long)]
        if dev.type == "cuda":
            src = src.pin_memory()
        src = src.to(dev, non_blocking=True)                   # [n, layers, 2, bs, Hkv, D]
        ids = torch.tensor(block_ids, dtype=torch.long, device=dev)
        for layer, c in enumerate(self.caches):
            float8_as_bytes(c.key)[ids] = src[:, layer, 0]
            float8_as_bytes(c.value)[ids] = src[:, layer, 1]
        self.blocks_to_device += len(block_ids)
