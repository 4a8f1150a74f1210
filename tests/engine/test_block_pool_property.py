"""Property test: random allocate / append / free / hit / evict sequences keep the pool sound."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvharbor.engine.block_pool import PINNED, SHARED, BlockPool
from kvharbor.engine.eviction import make_eviction_policy
from kvharbor.engine.kv_cache_manager import KVCacheManager
from kvharbor.engine.request import Request, SamplingParams

BS = 4
OPS = st.lists(st.tuples(st.sampled_from(["new", "append", "free", "resize", "reset", "pin", "unpin"]),
                         st.integers(0, 7), st.integers(1, 30), st.booleans()),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS)
# Found by this test on 2026-12-06: a pinned request whose prompt was already cached pins the
# cached shared block, which the premium demand did not count.
@example([("new", 2, 4, False), ("new", 5, 4, True), ("pin", 5, 1, False)])
# A cache reset drops the hashes of free blocks in their queues: under LFU their rank changes,
# and a block the policy was not told about could never be reused.
@example([("new", 0, 8, False), ("free", 0, 1, False), ("reset", 0, 1, False)])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_pool_integrity_under_random_operations(policy, ops):
    pool = BlockPool(num_blocks=32, num_pinned=6, policy=make_eviction_policy(policy))
    kv = KVCacheManager(pool, BS)
    live: dict[int, Request] = {}
    pins: list = []
    for op, key, n, pinned in ops:
        if op == "new" and key not in live:
            # A few shared prompt families so that prefix hits happen.
            prompt = [key % 3] * n
            req = Request(f"r{key}", prompt, SamplingParams(), pinned=pinned)
            hit = kv.get_computed_blocks(req)
            if kv.can_allocate(req, req.num_tokens - hit.num_tokens, hit):
                kv.allocate(req, req.num_tokens - hit.num_tokens, hit)
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req)
                live[key] = req
        elif op == "append" and key in live:
            req = live[key]
            req.all_token_ids.extend([7] * min(n, 5))
            new = req.num_tokens - req.num_computed_tokens
            if kv.can_allocate(req, new):
                kv.allocate(req, new)
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req)
        elif op == "free" and key in live:
            kv.free(live.pop(key))
        elif op == "resize":
            pool.resize_pinned(n % 12)
        elif op == "reset":
            pool.evict_all_cached()
        elif op == "pin" and key in live:
            pins.append((kv.pin_prefix(live[key]), live[key].pinned))
        elif op == "unpin" and pins:
            pool.unpin(pins.pop(key % len(pins))[0])
        pool.check_integrity()
        _assert_counters_match_recount(pool)
        _assert_pinned_class_blocks_bounded(pool, live.values(), pins)
        for req in live.values():
            assert len(req.blocks) * BS >= req.num_computed_tokens
            if not req.pinned:
                assert all(b.region != PINNED for b in req.blocks)
    for req in live.values():
        kv.free(req)
    for blocks, _ in pins:
        pool.unpin(blocks)
    pool.check_integrity()
    _assert_counters_match_recount(pool)
    assert all(b.ref_cnt == 0 for b in pool.blocks), "blocks leaked after freeing every request"
    for region, pinned in ((SHARED, False), (PINNED, True)):   # the policy reaches every free block
        free = pool.free[region].num_free
        assert len({id(b) for b in pool.allocate(free, pinned=pinned)}) == free


def _assert_counters_match_recount(pool: BlockPool) -> None:
    """The pool's O(1) counters equal a full recount of its blocks."""
    for region in ("pinned", "shared"):
        blocks = [b for b in pool.blocks if b.region == region]
        assert pool.region_counts(region) == {
            "total": len(blocks), "used": sum(b.ref_cnt > 0 for b in blocks),
            "cached": sum(b.ref_cnt == 0 and b.block_hash is not None for b in blocks),
            "free": sum(b.ref_cnt == 0 and b.block_hash is None for b in blocks),
            "permanent": sum(b.pin_cnt > 0 for b in blocks)}
    for pinned in (False, True):
        usable = [b for b in pool.blocks if pinned or b.region != PINNED]
        assert pool.capacity(pinned) == len(usable) - sum(b.pin_cnt > 0 for b in usable)


def _assert_pinned_class_blocks_bounded(pool: BlockPool, live, pins) -> None:
    """The premium demand (``pinned_class_blocks``) counts every block a pinned-class holder
    (request or pin) holds, and the pinned region's used blocks, once each. It may also count
    a shared block a pinned-class request took and left while another holder keeps it, never
    a block no pinned-class holder ever took."""
    held = {id(b): b for b in pool.blocks if b.ref_cnt > 0}
    premium = {i for i, b in held.items() if b.region == PINNED}
    premium |= {id(b) for r in live if r.pinned for b in r.blocks if b is not pool.null_block}
    premium |= {id(b) for blocks, pinned in pins if pinned for b in blocks}
    lower, others = len(premium), len(held) - len(premium)
    assert lower <= pool.pinned_class_blocks() <= lower + others
    assert pool.pinned_class_blocks() == lower + sum(held[i].borrowed for i in held.keys() - premium)
