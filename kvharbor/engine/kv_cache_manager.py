"""Per-request block tables over the BlockPool: prefix match, allocate, cache, free.

Check-then-act: the scheduler calls ``get_computed_blocks`` and ``can_allocate`` before
``allocate``, so a step never has to roll back. Block table of a request::

    tokens    |<- cached prefix ->|<- computed ->|<- this step ->|
    blocks    [b3][b8][b1]         [b5]           [b9][b10]
               hit (touched)        own            newly allocated
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import PINNED, BlockPool, KVCacheBlock
from .request import Request


@dataclass(slots=True)
class PrefixHit:
    """Blocks found in the prefix cache for a request, and the tokens they cover."""

    blocks: list[KVCacheBlock]
    num_tokens: int


class KVCacheManager:
    """Allocates and frees KV blocks for requests.

    Pinned-class requests take pinned blocks first and may borrow shared ones; other requests
    only ever hold shared blocks (a prefix hit on a pinned-region block is not used by them).
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.prefix_queries = 0       # prompt tokens looked up
        self.prefix_hits = 0          # of which found in the cache

    def get_computed_blocks(self, req: Request) -> PrefixHit:
        """Longest cached prefix of ``req`` (always leaving one token to compute)."""
        req.update_block_hashes(self.block_size)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None or (block.region == PINNED and not req.pinned):
                break
            hits.append(block)
        return PrefixHit(hits, len(hits) * self.block_size)

    def blocks_needed(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """New blocks to cover ``num_computed + hit + num_new_tokens`` tokens."""
        have = len(req.blocks) + (len(hit.blocks) if hit else 0)
        total = req.num_computed_tokens + (hit.num_tokens if hit else 0) + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def can_allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        needed = self.blocks_needed(req, num_new_tokens, hit)
        # Hit blocks that sit in a free queue stop being free when touched.
        free_hits = sum(1 for b in hit.blocks if b.ref_cnt == 0) if hit else 0
        return needed + free_hits <= self.pool.num_free(req.pinned)

    def allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> None:
        """Attach ``hit`` (first schedule only) and allocate blocks for ``num_new_tokens``."""
        if hit is not None and hit.blocks:
            self.pool.touch(hit.blocks)
            req.blocks.extend(hit.blocks)
            req.num_computed_tokens += hit.num_tokens
        needed = self.blocks_needed(req, num_new_tokens)
        req.blocks.extend(self.pool.allocate(needed, req.pinned))

    def record_hit(self, req: Request, hit: PrefixHit) -> None:
        """Count a first schedule's lookup for the hit-rate stats."""
        self.prefix_queries += req.num_tokens
        self.prefix_hits += hit.num_tokens

    def cache_full_blocks(self, req: Request) -> None:
        """Register every computed, full block of ``req`` in the prefix cache."""
        req.update_block_hashes(self.block_size)
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(num_full):
            block = req.blocks[i]
            if block.block_hash is None:
                self.pool.cache_block(block, req.block_hashes[i])

    def free(self, req: Request) -> None:
        """Release ``req``'s blocks, tail first (so a sequence's last blocks are evicted first)."""
        self.pool.release(reversed(req.blocks))
        req.blocks = []

    def pin_prefix(self, req: Request) -> list[KVCacheBlock]:
        """Keep ``req``'s full computed blocks referenced forever (a pinned system prompt)."""
        self.cache_full_blocks(req)
        keep = req.blocks[:req.num_computed_tokens // self.block_size]
        self.pool.touch(keep)
        return keep
