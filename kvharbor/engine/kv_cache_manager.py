"""Per-request block tables over the BlockPool: prefix match, allocate, cache, free, swap.

Check-then-act: the scheduler calls ``get_computed_blocks`` and ``can_allocate`` before
``allocate``, so a step never has to roll back. Block table of a request::

    tokens    |<-- prefix hit (device, host, own swap) -->|<- computed ->|<- this step ->|
    blocks    [b3][b8]   [b1][b6]       [b2][null][b4]       [b5]           [b9][b10]
               touched   fresh, loaded  fresh, loaded        own            newly allocated
                         from host      from its swap

Host and swap hits need fresh device blocks (``can_allocate`` counts them); their contents
are copied in by ``KVTransfer.flush`` before the step's forward. With a sliding window ``W``,
blocks wholly before ``num_computed_tokens - W + 1`` are released and replaced in the table by
the pool's null block (same table length, so position ``p`` stays in entry ``p // bs``)::

    window 64, bs 16, 100 computed:  [null][null][b4][b7][b2][b9][b1]   (keys 0..31 unused)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .block_pool import PINNED, BlockPool, KVCacheBlock
from .hashing import BlockHash
from .host_pool import HostKVPool, HostSlot
from .kv_transfer import KVTransfer
from .request import Request, SwapState


@dataclass(slots=True)
class PrefixHit:
    """What a (re)scheduled request need not compute: block indexes ``[0, len(blocks))`` on the
    device, then ``host_slots`` in the host tier, then ``swap_slots`` of its own swap (None:
    a null block); ``num_tokens`` tokens in all."""

    blocks: list[KVCacheBlock]
    num_tokens: int
    host_slots: list[HostSlot] = field(default_factory=list)
    swap_slots: list[HostSlot | None] = field(default_factory=list)

    @property
    def num_loaded(self) -> int:
        """Fresh device blocks the hit needs (host and swap blocks copied in)."""
        return len(self.host_slots) + sum(s is not None for s in self.swap_slots)

    @property
    def num_reused(self) -> int:
        """Table entries the hit fills without a fresh block (device hits and null blocks)."""
        return len(self.blocks) + sum(s is None for s in self.swap_slots)


def usable_by(block: KVCacheBlock, req: Request) -> bool:
    """Whether ``req`` may hold ``block``: a pinned-region block only by a pinned class."""
    return block.region != PINNED or req.pinned


class KVCacheManager:
    """Allocates and frees KV blocks for requests.

    Pinned-class requests take pinned blocks first and may borrow shared ones; other requests
    only ever hold shared blocks (a prefix hit on a pinned-region block is not used by them).
    ``host`` (the host tier, or None) serves prefix hits the device misses and swap-outs.
    """

    def __init__(self, pool: BlockPool, block_size: int, host: HostKVPool | None = None,
                 transfer: KVTransfer | None = None, sliding_window: int | None = None,
                 prefix_caching: bool = True) -> None:
        self.pool = pool
        self.prefix_caching = prefix_caching    # False: no request reads another's blocks
        self.block_size = block_size
        self.host, self.transfer = host, transfer
        self.sliding_window = sliding_window
        self.prefix_queries = 0       # prompt tokens looked up
        self.prefix_hits = 0          # of which found in the cache (device or host)
        self.host_hits = 0            # of which found in the host tier
        self.window_freed = 0         # blocks released by the sliding window
        self.swap_outs = self.swap_ins = 0
        # cache salt of every hash cached in either tier (flush filters); pruned of hashes
        # neither tier holds when it outgrows twice the two tiers
        self.scopes: dict[BlockHash, str | None] = {}

    def _hit_limit(self, req: Request) -> int:
        """Most leading blocks of ``req`` a prefix hit may cover: all full ones but the last
        token's (one token is always computed); none with prefix caching off."""
        return (req.num_tokens - 1) // self.block_size if self.prefix_caching else 0

    def max_hit_blocks(self, req: Request) -> int:
        """Most leading blocks a prefix hit of ``req`` may cover now (``_hit_limit``, and not
        the positions whose logits give its missing prompt logprobs)."""
        max_blocks = self._hit_limit(req)
        if req.prompt_lps_missing:          # the positions whose logits give the missing ones run
            max_blocks = min(max_blocks, (len(req.prompt_lps) - 1) // self.block_size)
        return max_blocks

    def get_computed_blocks(self, req: Request) -> PrefixHit:
        """Longest cached prefix of ``req`` (always leaving one token to compute): device
        blocks first, then host copies; a swapped-out request's own swap extends it."""
        bs = self.block_size
        req.update_block_hashes(bs)
        max_blocks = self.max_hit_blocks(req)
        hits: list[KVCacheBlock] = []
        host: list[HostSlot] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = None if host else self.pool.lookup(block_hash)
            if block is not None and usable_by(block, req):
                hits.append(block)
                continue
            slot = self.host.lookup(block_hash) if self.host is not None else None
            if slot is None:
                break
            host.append(slot)
        hit = PrefixHit(hits, (len(hits) + len(host)) * bs, host)
        if req.swap is not None and req.swap.num_tokens > hit.num_tokens:
            hit.swap_slots = req.swap.slots[len(hits) + len(host):]
            hit.num_tokens = req.swap.num_tokens
        return hit

    def blocks_needed(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """Fresh blocks to cover ``num_computed + hit + num_new_tokens`` tokens."""
        have = len(req.blocks) + (hit.num_reused if hit else 0)
        total = req.num_computed_tokens + (hit.num_tokens if hit else 0) + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def max_blocks_needed(self, req: Request) -> int:
        """Blocks ``req`` needs at its longest (prompt + ``max_tokens``), less its leading
        prefix hits on blocks pinned prefixes hold forever (those cost nothing)."""
        bs = self.block_size
        total = -(-(len(req.prompt_token_ids) + req.sampling.max_tokens) // bs)
        req.update_block_hashes(bs)
        hits = 0
        for block_hash in req.block_hashes[:self._hit_limit(req)]:
            block = self.pool.lookup(block_hash)
            if block is None or block.pin_cnt == 0 or not usable_by(block, req):
                break
            hits += 1
        return total - hits

    def fits_ever(self, req: Request, capacity: int) -> bool:
        """Whether ``req`` at its longest fits in ``capacity`` blocks: from its length alone
        when that fits (no hashing, no lookups), else by ``max_blocks_needed``."""
        whole = -(-(len(req.prompt_token_ids) + req.sampling.max_tokens) // self.block_size)
        return whole <= capacity or self.max_blocks_needed(req) <= capacity

    def can_allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        needed = self.blocks_needed(req, num_new_tokens, hit)
        # Hit blocks that sit in a free queue stop being free when touched.
        free_hits = sum(1 for b in hit.blocks if b.ref_cnt == 0) if hit else 0
        return needed + free_hits <= self.pool.num_free(req.pinned)

    def allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> None:
        """Attach ``hit`` (when (re)scheduled from waiting) and allocate for ``num_new_tokens``.

        Host and swap blocks get fresh device blocks and a pending copy each.
        """
        if hit is not None:
            self._revalidate_host(req, hit)
            self._drop_swap_unused(req, hit)
        needed = self.blocks_needed(req, num_new_tokens, hit)
        if hit is not None:
            self.pool.touch(hit.blocks, req.pinned)  # before allocating: free hits leave the queue
        fresh = iter(self.pool.allocate(needed, req.pinned))
        if hit is not None:
            req.blocks.extend(hit.blocks)
            for slot in hit.host_slots:
                req.blocks.append(self._load(slot, next(fresh), owned=False))
            for slot in hit.swap_slots:
                req.blocks.append(self.pool.null_block if slot is None else
                                  self._load(slot, next(fresh), owned=True))
            req.num_computed_tokens += hit.num_tokens
            self.swap_ins += bool(hit.swap_slots)
        req.blocks.extend(fresh)

    def _load(self, slot: HostSlot, block: KVCacheBlock, owned: bool) -> KVCacheBlock:
        self.transfer.load(slot, block.block_id, owned)
        return block

    def _revalidate_host(self, req: Request, hit: PrefixHit) -> None:
        """Cut the hit at a host entry dropped since lookup (a swap-out while making room)."""
        start = len(hit.blocks)
        for i, slot in enumerate(hit.host_slots):
            if self.host.slot_hash.get(slot) != req.block_hashes[start + i]:
                del hit.host_slots[i:]
                hit.swap_slots = []
                hit.num_tokens = (start + i) * self.block_size
                return

    def _drop_swap_unused(self, req: Request, hit: PrefixHit) -> None:
        """Release the swap slots the hit does not load (covered by cache hits, or all)."""
        if req.swap is None:
            return
        used = {s for s in hit.swap_slots if s is not None}
        self.host.release_owned([s for s in req.swap.slots if s is not None and s not in used])
        req.swap = None

    def record_hit(self, req: Request, hit: PrefixHit) -> None:
        """Count a first schedule's lookup for the hit-rate stats."""
        self.prefix_queries += req.num_tokens
        self.prefix_hits += hit.num_tokens
        self.host_hits += len(hit.host_slots) * self.block_size

    def cache_full_blocks(self, req: Request) -> None:
        """Register every computed, full block of ``req`` in the prefix cache."""
        null = self.pool.null_block
        # The cursor skips blocks cached by earlier steps. It is trusted only while the block
        # before it is still cached (or null): after a free / preemption it restarts at 0.
        start = req.cached_blocks_cursor
        if start > len(req.blocks) or (start and req.blocks[start - 1].block_hash is None
                                       and req.blocks[start - 1] is not null):
            start = 0
        if req.num_computed_tokens // self.block_size <= start:
            req.cached_blocks_cursor = start
            return                 # no block filled up since the cursor (most decode steps)
        req.update_block_hashes(self.block_size)
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(max(req.window_start, start), num_full):
            block = req.blocks[i]
            if block.block_hash is None and block is not null:
                self.pool.cache_block(block, req.block_hashes[i],
                                      req.block_hashes[i - 1] if i else None)
                self.scopes[req.block_hashes[i]] = req.scope
        req.cached_blocks_cursor = max(start, num_full)
        if len(self.scopes) > 2 * (len(self.pool.blocks) + (self.host.num_slots if self.host else 0)) + 64:
            self._prune_scopes()

    def _prune_scopes(self) -> None:
        host = self.host.cached if self.host is not None else {}
        self.scopes = {h: s for h, s in self.scopes.items() if h in self.pool.cached or h in host}

    def in_scopes(self, salts: set) -> Callable[[BlockHash], bool]:
        """A predicate: was this cached hash computed under one of ``salts`` (None: public)?"""
        missing = object()
        return lambda h: self.scopes.get(h, missing) in salts

    def free_outside_window(self, req: Request) -> int:
        """Release ``req``'s blocks that no future query can see (sliding window). Returns how many.

        Key ``k`` is visible to query ``p`` iff ``k > p - W``; future queries sit at
        ``p >= num_computed_tokens``, so block ``i`` is dead iff ``(i+1)*bs <= computed - W + 1``.
        """
        if not self.sliding_window:
            return 0
        dead = min((req.num_computed_tokens - self.sliding_window + 1) // self.block_size,
                   len(req.blocks))
        freed = 0
        for i in range(req.window_start, dead):
            if req.blocks[i] is not self.pool.null_block:
                self.pool.release([req.blocks[i]])
                req.blocks[i] = self.pool.null_block
                freed += 1
        req.window_start = max(req.window_start, dead)
        self.window_freed += freed
        return freed

    def free(self, req: Request) -> None:
        """Release ``req``'s blocks, tail first (so a sequence's last blocks are evicted first)."""
        self.pool.release(reversed(req.blocks))
        req.blocks = []
        req.window_start = 0

    def swap_out(self, req: Request) -> bool:
        """Record copies of ``req``'s computed blocks into owned host slots (the caller then
        frees its device blocks). False when there is no host tier or not enough room."""
        if self.transfer is None or req.num_computed_tokens == 0:
            return False
        blocks = req.blocks[:-(-req.num_computed_tokens // self.block_size)]
        real = [b for b in blocks if b is not self.pool.null_block]
        slots = self.host.take_owned(len(real))
        if slots is None:
            return False
        it = iter(slots)
        swap = []
        for block in blocks:
            slot = None if block is self.pool.null_block else next(it)
            if slot is not None:
                self.transfer.save(block.block_id, slot)
            swap.append(slot)
        req.swap = SwapState(swap, req.num_computed_tokens)
        self.swap_outs += 1
        return True

    def drop_swap(self, req: Request) -> None:
        """Release the host slots of a swapped-out request that will not come back (aborted)."""
        if req.swap is not None:
            self.host.release_owned([s for s in req.swap.slots if s is not None])
            req.swap = None

    def pin_prefix(self, req: Request) -> list[KVCacheBlock]:
        """Keep ``req``'s full computed blocks referenced forever (a pinned system prompt).
        Where a block is a copy of one already cached under its hash (the prefix was cached,
        and ``req`` recomputed its last block), the cached one is pinned when ``req``'s class
        may read it (as a prefix hit may): lookups would not find the copy while it lives."""
        self.cache_full_blocks(req)
        keep = []
        for block in req.blocks[:req.num_computed_tokens // self.block_size]:
            cached = self.pool.lookup(block.copy_of) if block.copy_of is not None else None
            keep.append(cached if cached is not None and usable_by(cached, req) else block)
        self.pool.pin(keep, req.pinned)
        return keep
