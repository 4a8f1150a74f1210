"""KV events keep the directory equal to the cache even when a hash is evicted and cached
again between two drains (one engine step can do both)."""

from __future__ import annotations

import random

from kvharbor import LLM, SamplingParams
from kvharbor.actors.prefix_directory import PrefixIndex
from kvharbor.engine.block_pool import BlockPool
from kvharbor.engine.hashing import hash_prompt_blocks


def test_a_hash_evicted_and_cached_again_in_one_drain_stays_in_the_directory():
    pool, index = BlockPool(2), PrefixIndex()
    h = hash_prompt_blocks(list(range(16)), 16)[0]
    (a,) = pool.allocate(1, pinned=False)
    pool.cache_block(a, h)
    pool.release([a])
    assert index.apply_events("r", 0, *pool.drain_events())
    pool.allocate(2, pinned=False)        # pressure: a's contents are evicted ...
    (b,) = [blk for blk in pool.blocks if blk.block_hash is None][:1]
    pool.cache_block(b, h)                # ... and the same prefix is computed again
    stored, removed = pool.drain_events()
    assert h in stored and h not in removed
    assert index.apply_events("r", 1, stored, removed)
    assert index.replica_hashes("r") == set(pool.cached)


def test_directory_mirrors_the_engine_after_every_step_under_eviction_pressure():
    llm = LLM(device="cpu", num_kv_blocks=24, max_num_batched_tokens=96)
    e, index, seq = llm.engine, PrefixIndex(), 0
    rng = random.Random(0)
    prefixes = [[rng.randrange(256) for _ in range(48)] for _ in range(3)]
    for i in range(24):
        tail = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
        e.add_request(f"r{i}", rng.choice(prefixes) + tail,
                      SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        if i % 3 == 2:
            for _ in range(4):
                e.step()
                for batch in e.drain_kv_events():
                    assert index.apply_events("replica", seq, batch.stored, batch.removed, batch.tier)
                    seq += 1
                assert index.replica_hashes("replica") == e.cached_block_hashes()
    assert e.pool.num_evictions > 0, "the test needs eviction pressure"
