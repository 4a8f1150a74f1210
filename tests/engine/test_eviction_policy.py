"""Eviction policy as a strategy: LRU reuses the block freed longest ago, LFU the least used one.

Every scenario here is one where the two policies must evict *different* blocks, so a policy
that ignores its rule (or a config that does not reach the pool) fails.
"""

from __future__ import annotations

import itertools
import random

import pytest

from kvharbor import LLM, SamplingParams
from kvharbor.config import EngineConfig, PlatformConfig
from kvharbor.engine.block_pool import BlockPool
from kvharbor.engine.eviction import LFUPolicy, LRUPolicy, make_eviction_policy
from kvharbor.engine.hashing import BlockHash

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
HOT, COLD, FRESH = BlockHash(b"h" * 16), BlockHash(b"c" * 16), BlockHash(b"f" * 16)


def _pool_with_hot_then_cold(policy) -> BlockPool:
    """Two cached blocks: HOT used 3 times and freed first, COLD used once and freed after."""
    pool = BlockPool(2, policy=policy)
    hot, cold = pool.allocate(1, False)[0], pool.allocate(1, False)[0]
    pool.cache_block(hot, HOT)
    pool.cache_block(cold, COLD)
    pool.touch([hot, hot])
    pool.release([hot, hot, hot])
    pool.release([cold])
    return pool


@pytest.mark.parametrize("policy, survivor", [(LRUPolicy(), COLD), (LFUPolicy(), HOT)])
def test_pool_evicts_by_recency_or_by_use_count(policy, survivor):
    pool = _pool_with_hot_then_cold(policy)
    block = pool.allocate(1, False)[0]
    pool.cache_block(block, FRESH)
    assert set(pool.cached) == {survivor, FRESH}
    pool.check_integrity()


def test_lfu_reuses_an_uncached_block_before_any_cached_one():
    pool = BlockPool(3, policy=LFUPolicy())
    blocks = pool.allocate(3, False)
    pool.cache_block(blocks[0], COLD)
    pool.release([blocks[0]])          # cached, used once, freed first
    pool.release([blocks[1], blocks[2]])  # no hash: nothing to lose
    taken = pool.allocate(2, False)
    assert {b.block_id for b in taken} == {blocks[1].block_id, blocks[2].block_id}
    assert COLD in pool.cached
    pool.check_integrity()


def test_lfu_orders_a_reused_block_by_its_latest_free():
    """Equal uses: the block freed longest ago goes first. A block evicted, refilled and freed
    again is ordered by that last free, not by the heap entry of its first life."""
    pool = BlockPool(3, policy=LFUPolicy())
    a, b, c = pool.allocate(3, False)
    for block, h in ((a, COLD), (b, HOT), (c, FRESH)):
        pool.cache_block(block, h)
    pool.release([a])
    pool.release([b])
    pool.release([c])
    again = pool.allocate(1, False)[0]             # evicts a (COLD), the oldest
    assert again is a and COLD not in pool.cached
    pool.cache_block(a, BlockHash(b"n" * 16))
    pool.release([a])                              # now the newest free block
    assert pool.allocate(1, False)[0] is b         # b was freed before a's second free
    assert HOT not in pool.cached and FRESH in pool.cached
    pool.check_integrity()


def test_lfu_keeps_its_order_and_its_bound_through_compactions():
    """Prefix hits on free cached blocks, round after round (a hit takes the block off its
    queue, its release queues it again): each leaves a stale heap entry behind. LFU compacts
    its heap again and again, keeping it within 4 x free + 64 entries, and still evicts by
    (uses, latest free)."""
    rng = random.Random(5)
    policy = LFUPolicy()
    pool = BlockPool(64, policy=policy)
    blocks = pool.allocate(pool.num_free(False), False)
    for i, block in enumerate(blocks):
        pool.cache_block(block, BlockHash(i.to_bytes(16, "little")))
    last_free = {block.block_id: i for i, block in enumerate(blocks)}
    freed = itertools.count(len(blocks))
    pool.release(blocks)
    for _ in range(300):
        hits = rng.sample(blocks, 3)
        pool.touch(hits)
        pool.release(hits)
        for block in hits:
            last_free[block.block_id] = next(freed)
        assert max(len(h) for h in policy._heaps.values()) <= 4 * len(blocks) + 64
    order = sorted(blocks, key=lambda b: (b.uses, last_free[b.block_id]))
    assert [b.block_id for b in pool.allocate(len(blocks), False)] == [b.block_id for b in order]
    pool.check_integrity()


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _held(llm, prompt) -> int:
    req = llm.engine.add_request(f"probe-{len(llm.engine.requests)}", prompt, SamplingParams(max_tokens=1))
    req.update_block_hashes(16)
    llm.engine.abort(req.request_id)
    return sum(h in llm.engine.pool.cached for h in req.block_hashes)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_engine_policy_keeps_the_recent_or_the_popular_prefix(policy):
    """Prefix P (8 blocks) is served 3 times, then Q (8 blocks) once; then a distinct prompt
    needs more blocks than are free. LRU evicts the older P; LFU keeps P's reused blocks and
    evicts the once-used Q instead."""
    llm = LLM(device="cpu", num_kv_blocks=24, eviction_policy=policy)
    assert llm.engine.pool.policy.name == policy
    hot, cold = _tokens(128, 1), _tokens(128, 2)
    for _ in range(3):
        llm.generate([hot], GREEDY)
    llm.generate([cold], GREEDY)
    llm.generate([_tokens(200, 3)], GREEDY)              # 13 blocks: evicts about 7 cached ones
    held_hot, held_cold = _held(llm, hot), _held(llm, cold)
    if policy == "lru":
        assert held_cold == 8 and held_hot < 7, (held_hot, held_cold)
    else:
        assert held_hot >= 7 and held_cold < 8, (held_hot, held_cold)
    llm.check_integrity()


def test_policy_is_chosen_in_config_and_bad_names_are_refused():
    assert EngineConfig().eviction_policy == PlatformConfig().eviction_policy == "lru"
    assert isinstance(make_eviction_policy("lfu"), LFUPolicy)
    with pytest.raises(ValueError, match="eviction_policy"):
        make_eviction_policy("mru")
    with pytest.raises(ValueError):
        EngineConfig(eviction_policy="random")
