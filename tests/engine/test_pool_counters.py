"""Block-pool counters are O(1): add_request, stats() and region_counts visit no block,
however large the cache (counted visits, not time)."""

from __future__ import annotations

import pytest

from kvharbor import LLM, SamplingParams
from kvharbor.engine import block_pool
from kvharbor.engine.block_pool import BlockPool

from .conftest import start_request


class _CountingList(list):
    """A list that counts the items its iterations and index reads hand out."""

    visits = 0

    def __iter__(self):
        for item in super().__iter__():
            _CountingList.visits += 1
            yield item

    def __getitem__(self, i):
        got = super().__getitem__(i)
        _CountingList.visits += len(got) if isinstance(i, slice) else 1
        return got


@pytest.fixture
def visits(monkeypatch):
    """Counter of block visits: pool.blocks reads and free-queue walks."""
    walk = block_pool.FreeBlockQueue.__iter__

    def counted(queue):
        for block in walk(queue):
            _CountingList.visits += 1
            yield block

    monkeypatch.setattr(block_pool.FreeBlockQueue, "__iter__", counted)
    _CountingList.visits = 0
    return _CountingList


def _cost(llm: LLM, num_blocks: int, visits, monkeypatch) -> int:
    """Block visits of one add_request + stats() + region_counts on a pool of ``num_blocks``."""
    e = llm.engine
    pool = BlockPool(num_blocks, num_blocks // 10)
    pool.blocks = _CountingList(pool.blocks)
    monkeypatch.setattr(e, "pool", pool)
    monkeypatch.setattr(e.kv, "pool", pool)
    e.pin_prefix(list(range(64)), qos="premium")             # some permanent blocks
    visits.visits = 0
    e.add_request(f"r{num_blocks}", list(range(40)), SamplingParams(max_tokens=8), qos="standard")
    e.stats()
    pool.region_counts("pinned"), pool.region_counts("shared")
    e.abort(f"r{num_blocks}")
    return visits.visits


def test_add_request_and_stats_cost_the_same_at_1k_and_100k_blocks(visits, monkeypatch):
    llm = LLM(device="cpu", num_kv_blocks=64)
    small = _cost(llm, 1_000, visits, monkeypatch)
    large = _cost(llm, 100_000, visits, monkeypatch)
    assert small == large == 0, f"block visits: {small} at 1,000 blocks, {large} at 100,000"


def test_counters_match_a_recount_after_a_workload():
    llm = LLM(device="cpu", num_kv_blocks=48, pinned_kv_blocks=8)
    llm.engine.pin_prefix(list(range(48)), qos="premium")
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate([[i % 7] * (20 + 9 * i) for i in range(8)], sp, qos="standard")
    llm.generate([list(range(48)) + [3] * 20], sp, qos="premium")
    pool = llm.engine.pool
    pool.resize_pinned(12)
    for region in ("pinned", "shared"):
        blocks = [b for b in pool.blocks if b.region == region]
        counts = pool.region_counts(region)
        assert counts["total"] == len(blocks)
        assert counts["used"] == sum(b.ref_cnt > 0 for b in blocks)
        assert counts["cached"] == sum(b.ref_cnt == 0 and b.block_hash is not None for b in blocks)
        assert counts["free"] == sum(b.ref_cnt == 0 and b.block_hash is None for b in blocks)
        assert counts["permanent"] == sum(b.pin_cnt > 0 for b in blocks)
    s = llm.stats()
    assert s["pinned_blocks_used"] == 3 and s["blocks_used"] == 3 + s["shared_blocks_used"]
    assert s["blocks_used"] + s["blocks_free"] == s["blocks_total"]
    llm.check_integrity()


def test_stats_partition_the_blocks_and_count_cached_ones_as_free():
    """What ``LLM.stats()`` (and the router, from a replica's stats) reads: used + free is the
    whole of each region, free includes cached (evictable) blocks, empty does not."""
    llm = LLM(device="cpu", num_kv_blocks=48, pinned_kv_blocks=8)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([[i % 5] * (40 + 7 * i) for i in range(4)], sp, qos="standard")
    llm.generate([[9] * 50], sp, qos="premium")
    pool = llm.engine.pool
    s = llm.stats()
    shared, pinned = pool.region_counts("shared"), pool.region_counts("pinned")
    assert shared["cached"] > 0 and pinned["cached"] > 0, "the workload should leave cached blocks"
    assert s["shared_blocks_free"] == shared["free"] + shared["cached"]
    assert s["shared_blocks_empty"] == shared["free"]
    assert s["shared_blocks_used"] + s["shared_blocks_free"] == s["shared_blocks_total"]
    assert s["pinned_blocks_used"] + s["pinned_blocks_reserved_idle"] == s["pinned_blocks_total"]
    assert s["blocks_used"] + s["blocks_free"] == s["blocks_total"] == 48


def test_stats_walks_the_model_once_not_at_every_call(monkeypatch):
    """A replica reads ``stats()`` at every step; walking every module for the weights' bytes
    took 0.3 ms of a tiny model's step and 2.2 ms on a 30-layer one."""
    llm = LLM(model="kvharbor/tiny-llama", device="cpu", num_kv_blocks=64)
    model = type(llm.engine.runner.model)
    walks = {"parameters": 0, "buffers": 0}
    for name in walks:
        original = getattr(model, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            walks[_name] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(model, name, counted)
    first = llm.stats()["memory_bytes"]["device"]["model_weights"]
    after_first = dict(walks)
    llm.generate(["a short prompt"], SamplingParams(max_tokens=2, temperature=0.0))
    for _ in range(5):
        assert llm.stats()["memory_bytes"]["device"]["model_weights"] == first
    assert walks == after_first, f"stats() walked the model again: {walks} after {after_first}"
    assert first == sum(p.nbytes for p in llm.engine.runner.model.parameters()) + \
        sum(b.nbytes for b in llm.engine.runner.model.buffers())


def test_premium_demand_counts_each_block_once_and_borrowed_shared_blocks_too():
    """``pinned_class_blocks`` (what the pinned region is sized for): a pinned-class request
    that overflows the 2-block region borrows shared blocks, hits on them count, and blocks
    two premium requests share count once."""
    from kvharbor.engine.kv_cache_manager import KVCacheManager

    pool = BlockPool(num_blocks=8, num_pinned=2)
    kv = KVCacheManager(pool, 4)

    def premium(rid: str):
        return start_request(kv, rid, [1] * 16, pinned=True)

    a = premium("a")                 # 2 pinned blocks + 2 borrowed shared ones
    assert [b.region for b in a.blocks] == ["pinned", "pinned", "shared", "shared"]
    assert pool.pinned_class_blocks() == 4
    kv.free(a)
    assert pool.pinned_class_blocks() == 0
    b = premium("b")                 # hits a's first 3 blocks (one shared) + 1 fresh shared
    assert pool.pinned_class_blocks() == 4
    c = premium("c")                 # hits the same 3 blocks + 1 fresh shared: 1 more
    assert pool.pinned_class_blocks() == 5
    kv.free(b)
    kv.free(c)
    assert pool.pinned_class_blocks() == 0
    pool.check_integrity()


def test_stats_count_prefix_lookups_and_waiting_requests():
    """prefix_query_tokens: every prompt token looked up, hits or not; prefix_hit_tokens: of
    those, the ones found (whole blocks). num_waiting: requests queued behind max_num_seqs."""
    llm = LLM(device="cpu", num_kv_blocks=48, max_num_seqs=2)
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompt = [i % 200 for i in range(40)]
    llm.generate([prompt], sp)
    llm.generate([prompt], sp)
    s = llm.stats()
    assert (s["prefix_query_tokens"], s["prefix_hit_tokens"]) == (80, 32)
    for i in range(3):
        llm.engine.add_request(f"w{i}", [5, 6, 7], sp)
    llm.engine.step()
    s = llm.stats()
    assert (s["num_running"], s["num_waiting"]) == (2, 1)


def test_stats_count_prompt_and_generated_tokens_and_how_requests_ended():
    """The request counters a replica exports: every prompt token added, every token
    generated, requests finished and requests aborted (by the caller or as never fitting)."""
    llm = LLM(device="cpu", num_kv_blocks=32)
    e = llm.engine
    llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    e.add_request("cut", [9] * 6, SamplingParams(max_tokens=50))
    e.step()
    e.abort("cut")
    big = e.add_request("big", [10] * 300, SamplingParams(max_tokens=20))  # 20 blocks of 32
    e.pin_prefix([11] * 320, qos="standard")                                # leaves 12
    assert e.reject_unfittable() and big.finish_reason == "error"
    s = llm.stats()
    assert (s["prompt_tokens"], s["generated_tokens"]) == (3 + 5 + 6 + 300, 3 + 3 + 1)
    assert (s["requests_finished"], s["requests_aborted"]) == (2, 2)


def test_check_integrity_catches_a_stray_borrowed_flag_and_a_used_null_block():
    """The pool's own check: ``borrowed`` marks only shared blocks a pinned-class request
    holds (one on a free or pinned-region block is a counting bug), and the null block is
    never referenced, cached or queued."""
    pool = BlockPool(num_blocks=8, num_pinned=3)
    free_pinned, held_pinned, _, held_shared = pool.allocate(4, pinned=True)
    pool.release([free_pinned])
    pool.check_integrity()
    assert pool.borrowed == 1 and held_shared.borrowed and held_shared.region == "shared"
    strays = (held_pinned, pool.blocks[7], free_pinned)           # pinned; free; free and pinned
    assert [(b.region, b.ref_cnt) for b in strays] == [("pinned", 1), ("shared", 0), ("pinned", 0)]
    for stray in strays:
        stray.borrowed, pool.borrowed = True, 2
        with pytest.raises(AssertionError, match="borrowed block that is free or pinned"):
            pool.check_integrity()
        stray.borrowed, pool.borrowed = False, 1
    pool.check_integrity()
    null, used = pool.null_block, {"ref_cnt": 1, "block_hash": b"h", "prev": pool.blocks[0]}
    for fields in [[name] for name in used] + [list(used)]:      # each alone, then all three
        for name in fields:
            setattr(null, name, used[name])
        with pytest.raises(AssertionError, match="null block used"):
            pool.check_integrity()
        null.ref_cnt, null.block_hash, null.prev = 0, None, None
    pool.check_integrity()
