"""KV blocks, the LRU free queues, the cached-block map and the pinned region.

Every block is in exactly one of three states::

    used    ref_cnt > 0               (held by running requests or by a pinned prefix)
    cached  ref_cnt == 0, has a hash  (in a free queue AND in the cached map: reusable on a hit)
    free    ref_cnt == 0, no hash     (in a free queue only)

and in one of two regions, ``pinned`` (reserved for pinned QoS classes) or ``shared``. Each
region has its own free queue. A free queue is an intrusive doubly-linked list threaded
through the blocks with sentinel head and tail, so reading the head, appending and removing
from the middle are O(1) and allocate nothing. It is the order blocks were freed::

    head <-> b7 <-> b2 <-> b9 <-> tail
             ^ freed first         ^ freed last

The pool's eviction policy (``eviction.py``: ``lru``, the head, by default; or ``lfu``) picks
which linked block is reused next.

Counters (per region, kept exact by the pool itself so every query is O(1)): ``total``,
the free queue's ``num_free`` and ``num_cached`` (free blocks with a hash), and ``permanent``
(distinct blocks held forever by pinned prefixes, ``pin_cnt > 0``). ``used = total - num_free``.
``borrowed`` counts shared-region blocks a pinned-class request took a reference to (allocated
when the pinned region was full, or a shared block it hit), until they are free again:
``pinned_class_blocks`` (the pinned region's used blocks plus these) is the premium demand the
region is sized for, each block counted once however many requests hold it.

Prefix closure: each cached block remembers its parent's hash (the block before it in the
chain). ``orphans`` counts cached blocks whose parent is not cached; at 0 the cache is
*prefix-closed* (every cached block's ancestors are cached), which LRU keeps, since a request
frees its blocks tail first. KV event batches carry it, so a router may find how many
leading blocks of a prompt a replica holds by bisection instead of a lookup per block.

Copies: two requests that compute the same block in one step each fill a block, and only the
first is registered; the second (``copy_of`` its hash) holds the same contents. When the
registered block is evicted while a copy is still intact, the copy takes its place under the
hash (no KV event: the replica still holds the hash). Without that, the second request's
later blocks, registered with the first's as parent, would be cut off from their prefix: an
orphan no prefix match can reach. A copy is forgotten when its block is reused or moved.

A cached block keeps its hash while it sits in the queue; the hash (and the cached-map entry)
is dropped only when the block is popped for reuse. That drop is an *eviction*; it is
reported as a "removed" KV event, and ``on_evict(block_id, hash)`` (the host tier's offload
hook, when set) is told before the block's old contents are overwritten.

``null_block`` (id ``num_blocks``: one extra row of the cache tensors, outside both regions)
stands in block tables for blocks a sliding-window request has released: attention masks
those positions, so it is never read, and it is never written, referenced or freed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NewType

from .eviction import LRUPolicy
from .hashing import BlockHash

BlockId = NewType("BlockId", int)
PINNED, SHARED, NULL = "pinned", "shared", "null"


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's cache."""

    block_id: BlockId
    region: str = SHARED
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    pin_cnt: int = 0                       # references held by pinned prefixes (part of ref_cnt)
    uses: int = 0                          # references taken since it was filled (LFU's count)
    parent_hash: BlockHash | None = None   # the chain's previous block (None: the first block)
    cached_kids: int = 0                   # cached blocks whose parent_hash is this one's hash
    copy_of: BlockHash | None = None       # an uncached duplicate of this cached hash's block
    borrowed: bool = False                 # shared, and a pinned-class request took a reference
    prev: KVCacheBlock | None = field(default=None, repr=False)
    next: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Intrusive doubly-linked list of free blocks; head is the next to be reused.

    Invariants: ``num_free`` = blocks linked; ``num_cached`` = linked blocks with a hash (the
    pool keeps it exact when it hashes or evicts a linked block). A block is linked iff its
    ``prev`` is set.
    """

    def __init__(self) -> None:
        self.head = KVCacheBlock(BlockId(-1))
        self.tail = KVCacheBlock(BlockId(-2))
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        self.num_cached = 0

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev
        last.next, block.prev, block.next, self.tail.prev = block, last, self.tail, block
        self.num_free += 1
        self.num_cached += block.block_hash is not None

    def remove(self, block: KVCacheBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1
        self.num_cached -= block.block_hash is not None

    def __iter__(self):
        node = self.head.next
        while node is not self.tail:
            yield node
            node = node.next


class KVEventLog:
    """Hashes cached and dropped since the last drain, netted so a hash's last event wins.

    A block can be evicted and its hash cached again within one engine step. Sent as two
    lists, the directory (which applies stored, then removed) would then forget a block the
    replica holds; netting keeps only the final state of each hash, in order of last change.
    """

    def __init__(self) -> None:
        self._last: dict[BlockHash, bool] = {}      # hash -> cached after its last event

    def stored(self, block_hash: BlockHash) -> None:
        self._last.pop(block_hash, None)
        self._last[block_hash] = True

    def removed(self, block_hash: BlockHash) -> None:
        self._last.pop(block_hash, None)
        self._last[block_hash] = False

    def drain(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Return and clear ``(stored, removed)``: disjoint, each in order of last change."""
        last, self._last = self._last, {}
        return [h for h, cached in last.items() if cached], [h for h, cached in last.items() if not cached]


class BlockPool:
    """All KV blocks of one engine, split into a pinned and a shared region.

    Args:
        num_blocks: total blocks.
        num_pinned: blocks reserved for pinned QoS classes (ids ``0 .. num_pinned-1`` at start).
        policy: the eviction policy (``eviction.py``); default LRU.
    """

    def __init__(self, num_blocks: int, num_pinned: int = 0, policy: LRUPolicy | None = None) -> None:
        if not 0 <= num_pinned <= num_blocks:
            raise ValueError(f"pinned_kv_blocks must be in [0, num_kv_blocks={num_blocks}], got {num_pinned}")
        self.blocks = [KVCacheBlock(BlockId(i), PINNED if i < num_pinned else SHARED)
                       for i in range(num_blocks)]
        self.free = {PINNED: FreeBlockQueue(), SHARED: FreeBlockQueue()}
        self.policy = policy or LRUPolicy()
        for block in self.blocks:
            self._link(block)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_pinned = num_pinned
        self.total = {PINNED: num_pinned, SHARED: num_blocks - num_pinned}
        self.permanent = {PINNED: 0, SHARED: 0}     # distinct blocks held by pinned prefixes
        self.borrowed = 0                           # shared blocks held for pinned classes
        self.events = KVEventLog()
        self.num_evictions = 0
        self.orphans = 0                            # cached blocks whose parent is not cached
        self._waiting: dict[BlockHash, int] = {}    # uncached parent -> its cached children
        self._copies: dict[BlockHash, list[KVCacheBlock]] = {}   # cached hash -> its intact copies
        self.null_block = KVCacheBlock(BlockId(num_blocks), NULL)
        self.on_evict: Callable[[BlockId, BlockHash], None] | None = None

    # ---- allocation -------------------------------------------------------------------
    def num_free(self, pinned: bool) -> int:
        """Blocks a request may allocate: shared ones, plus pinned ones for pinned classes."""
        return self.free[SHARED].num_free + (self.free[PINNED].num_free if pinned else 0)

    def capacity(self, pinned: bool, max_pinned: int | None = None) -> int:
        """Most blocks one request of a class could ever hold: its regions minus the blocks
        pinned prefixes hold forever. ``max_pinned``: the largest the pinned region may grow
        to (a shared-only class loses those blocks to it); default its size now. O(1)."""
        shared = len(self.blocks) - max(self.num_pinned, max_pinned or 0)
        if pinned:
            return len(self.blocks) - self.permanent[PINNED] - self.permanent[SHARED]
        return shared - self.permanent[SHARED]

    def allocate(self, n: int, pinned: bool) -> list[KVCacheBlock]:
        """Take ``n`` blocks (pinned region first for pinned classes), each with ref_cnt 1.

        The caller checks ``num_free`` first; running out here is a bug.
        """
        out = []
        for _ in range(n):
            queue = self.free[PINNED] if pinned and self.free[PINNED].num_free else self.free[SHARED]
            block = self.policy.victim(queue)
            queue.remove(block)
            self._evict(block, offload=True)
            block.ref_cnt, block.uses = 1, 0
            if pinned and block.region == SHARED:
                self._borrow(block)
            self.policy.on_use(block)
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock], pinned: bool = False) -> None:
        """Take a reference on prefix-hit blocks, unlinking free ones from their queue
        (``pinned``: for a request of a pinned class)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free[block.region].remove(block)
            block.ref_cnt += 1
            if pinned and block.region == SHARED:
                self._borrow(block)
            self.policy.on_use(block)

    def _borrow(self, block: KVCacheBlock) -> None:
        if not block.borrowed:
            block.borrowed = True
            self.borrowed += 1

    def pinned_class_blocks(self) -> int:
        """Distinct blocks pinned-class work holds: the pinned region's used blocks (only
        pinned classes and pinned prefixes take them) plus the borrowed shared ones. O(1)."""
        return self.total[PINNED] - self.free[PINNED].num_free + self.borrowed

    def pin(self, blocks: Iterable[KVCacheBlock], pinned: bool = False) -> None:
        """Hold ``blocks`` forever (a pinned prefix): a reference each, counted as permanent
        (``pinned``: for a pinned class, whose shared blocks count as borrowed)."""
        for block in blocks:
            self.touch((block,), pinned)
            if block.pin_cnt == 0:
                self.permanent[block.region] += 1
            block.pin_cnt += 1

    def unpin(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Undo one ``pin`` of each block (a pinned prefix removed from the configuration)."""
        for block in blocks:
            block.pin_cnt -= 1
            if block.pin_cnt == 0:
                self.permanent[block.region] -= 1
            self.release((block,))

    def release(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to their queue's tail (in the given order)."""
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.borrowed:
                    block.borrowed = False
                    self.borrowed -= 1
                self._link(block)

    # ---- prefix cache -----------------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash,
                    parent: BlockHash | None = None) -> None:
        """Register a full block under its hash (no-op if another block already holds it).

        ``parent``: the hash of the block before it in the chain (None for a first block).
        A block whose hash another block holds is remembered as that block's copy.
        """
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            if block.copy_of is None:
                block.copy_of = block_hash
                self._copies.setdefault(block_hash, []).append(block)
            return
        block.block_hash, block.parent_hash = block_hash, parent
        self.cached[block_hash] = block
        if parent is not None:
            above = self.cached.get(parent)
            if above is not None:
                above.cached_kids += 1
            else:
                self.orphans += 1
                self._waiting[parent] = self._waiting.get(parent, 0) + 1
        block.cached_kids = adopted = self._waiting.pop(block_hash, 0)
        self.orphans -= adopted
        if block.prev is not None:                      # hashed while in a free queue
            self.free[block.region].num_cached += 1
            self.policy.on_free(block, self.free[block.region])
        self.events.stored(block_hash)

    def _evict(self, block: KVCacheBlock, offload: bool = False, promote: bool = True) -> None:
        """``block``'s contents are about to go: drop its hash, or hand the hash to an
        intact copy (``promote``); forget it as a copy."""
        if block.copy_of is not None:
            self._forget_copy(block)
        if block.block_hash is None:
            return
        if block.prev is not None:                      # dropped while in a free queue
            self.free[block.region].num_cached -= 1
        if self.cached.get(block.block_hash) is block:
            copies = self._copies.pop(block.block_hash, None)
            if copies and promote:
                self._promote(block, copies)
            else:
                for copy in copies or ():
                    copy.copy_of = None
                del self.cached[block.block_hash]
                self._uncache(block)
                self.events.removed(block.block_hash)
                self.num_evictions += 1
                if offload and self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
        block.block_hash = None
        if block.prev is not None:                      # still linked: its rank changed
            self.policy.on_free(block, self.free[block.region])

    def _forget_copy(self, block: KVCacheBlock) -> None:
        copies = self._copies[block.copy_of]
        copies.remove(block)
        if not copies:
            del self._copies[block.copy_of]
        block.copy_of = None

    def _promote(self, block: KVCacheBlock, copies: list[KVCacheBlock]) -> None:
        """Register a copy in ``block``'s place: one still held by a request if any (it
        stays intact longest), else the one freed last. The hash stays cached: no event."""
        held = [c for c in copies if c.ref_cnt]
        heir = held[0] if held else copies[-1]
        copies.remove(heir)
        h = heir.copy_of
        heir.copy_of, heir.block_hash, heir.parent_hash = None, h, block.parent_hash
        heir.cached_kids, block.cached_kids, block.parent_hash = block.cached_kids, 0, None
        self.cached[h] = heir
        if copies:
            self._copies[h] = copies
        if heir.prev is not None:                       # a free copy becomes a cached block
            self.free[heir.region].num_cached += 1
            self.policy.on_free(heir, self.free[heir.region])

    def _uncache(self, block: KVCacheBlock) -> None:
        """Closure counts after ``block`` left the cached map: its children lose a parent."""
        parent = block.parent_hash
        if parent is not None:
            above = self.cached.get(parent)
            if above is not None:
                above.cached_kids -= 1
            else:
                self.orphans -= 1
                left = self._waiting[parent] - 1
                if left:
                    self._waiting[parent] = left
                else:
                    del self._waiting[parent]
        if block.cached_kids:
            self.orphans += block.cached_kids
            self._waiting[block.block_hash] = block.cached_kids
            block.cached_kids = 0
        block.parent_hash = None

    @property
    def prefix_closed(self) -> bool:
        """Whether every cached block's parent is cached too (see the module doc)."""
        return self.orphans == 0

    def evict_all_cached(self, match: Callable[[BlockHash], bool] | None = None) -> int:
        """Drop every free cached block's hash (a cache reset), or only those ``match``
        accepts. Returns how many."""
        n = 0
        for queue in self.free.values():
            for block in queue:
                if block.block_hash is not None and (match is None or match(block.block_hash)):
                    self._evict(block, promote=False)
                    n += 1
        return n

    # ---- pinned region ----------------------------------------------------------------
    def resize_pinned(self, target: int) -> int:
        """Grow the pinned region from free shared blocks or shrink it by idle pinned ones.

        Moves only free blocks, so it may stop short of ``target``. Returns the new size.
        """
        while self.num_pinned < target and self.free[SHARED].num_free:
            self._move(self._pop_victim(SHARED), PINNED)
        while self.num_pinned > target and self.free[PINNED].num_free:
            self._move(self._pop_victim(PINNED), SHARED)
        return self.num_pinned

    def _link(self, block: KVCacheBlock) -> None:
        """Append a free block to its region's queue and tell the policy."""
        queue = self.free[block.region]
        queue.append(block)
        self.policy.on_free(block, queue)

    def _pop_victim(self, region: str) -> KVCacheBlock:
        block = self.policy.victim(self.free[region])
        self.free[region].remove(block)
        return block

    def _move(self, block: KVCacheBlock, region: str) -> None:
        self._evict(block, offload=True)
        block.uses = 0
        self.total[block.region] -= 1
        block.region = region
        self.total[region] += 1
        self._link(block)
        self.num_pinned += 1 if region == PINNED else -1

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Return and clear (stored, removed) hashes since the last call (netted)."""
        return self.events.drain()

    # ---- accounting -------------------------------------------------------------------
    def region_counts(self, region: str) -> dict[str, int]:
        """Blocks of ``region`` by state: used, cached (free with hash), free (no hash). O(1)."""
        queue, total = self.free[region], self.total[region]
        return {"total": total, "used": total - queue.num_free, "cached": queue.num_cached,
                "free": queue.num_free - queue.num_cached, "permanent": self.permanent[region]}

    def check_integrity(self) -> None:
        """Assert: every counter equals a full recount; queue links, refs and the cached map agree."""
        seen = set()
        for region, queue in self.free.items():
            count = cached = 0
            node = queue.head
            while node.next is not queue.tail:
                assert node.next.prev is node, "broken free-queue link"
                node = node.next
                assert node.ref_cnt == 0, f"block {node.block_id} in free queue with refs"
                assert node.region == region, f"block {node.block_id} in wrong region queue"
                assert node.block_id not in seen, f"block {node.block_id} queued twice"
                seen.add(node.block_id)
                count += 1
                cached += node.block_hash is not None
            assert count == queue.num_free, f"{region} free count {queue.num_free} != {count}"
            assert cached == queue.num_cached, f"{region} cached count {queue.num_cached} != {cached}"
        for block in self.blocks:
            assert block.ref_cnt >= block.pin_cnt >= 0, f"block {block.block_id} has bad refs"
            assert (block.ref_cnt == 0) == (block.block_id in seen), f"block {block.block_id} lost"
            assert (block.prev is not None) == (block.block_id in seen), f"block {block.block_id} link"
        for h, block in self.cached.items():
            assert block.block_hash == h, "cached map entry does not match block hash"
        kids: dict = {}
        for block in self.cached.values():
            if block.parent_hash is not None:
                kids[block.parent_hash] = kids.get(block.parent_hash, 0) + 1
        waiting = {p: n for p, n in kids.items() if p not in self.cached}
        assert self.orphans == sum(waiting.values()), f"orphans {self.orphans} != recount"
        assert self._waiting == waiting, "waiting children disagree with a recount"
        assert all(b.cached_kids == kids.get(h, 0) for h, b in self.cached.items()), \
            "cached children count drifted"
        copies = {}
        for block in self.blocks:
            if block.copy_of is not None:
                assert block.block_hash is None, f"block {block.block_id} is a copy and cached"
                copies.setdefault(block.copy_of, []).append(block.block_id)
        assert {h: sorted(b.block_id for b in c) for h, c in self._copies.items()} == \
            {h: sorted(ids) for h, ids in copies.items()}, "copies disagree with the blocks"
        assert all(h in self.cached for h in copies), "a copy of a hash no block holds"
        for region in (PINNED, SHARED):
            assert self.total[region] == sum(b.region == region for b in self.blocks), f"{region} total"
            assert self.permanent[region] == sum(b.region == region and b.pin_cnt > 0
                                                 for b in self.blocks), f"{region} permanent"
        assert self.total[PINNED] == self.num_pinned
        assert all(b.ref_cnt > 0 and b.region == SHARED for b in self.blocks if b.borrowed), \
            "a borrowed block that is free or pinned"
        assert self.borrowed == sum(b.borrowed for b in self.blocks), "borrowed count drifted"
        null = self.null_block
        assert null.ref_cnt == 0 and null.block_hash is None and null.prev is None, "null block used"
