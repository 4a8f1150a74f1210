"""The pool knows whether its cache is prefix-closed (every cached block's parent cached),
and says so in each device KV event batch: a router matches closed replicas by bisection,
so a wrong "closed" would send it to the wrong replica."""

from __future__ import annotations

import random

from kvharbor.engine.block_pool import BlockPool
from kvharbor.engine.kv_cache_manager import KVCacheManager
from kvharbor.engine.request import Request, SamplingParams

BS = 4


def _start(kv: KVCacheManager, rid: str, prompt: list[int], use_cache: bool = True) -> Request:
    """Schedule ``prompt`` whole, compute it and cache its full blocks."""
    req = Request(rid, prompt, SamplingParams())
    hit = kv.get_computed_blocks(req) if use_cache else None
    done = hit.num_tokens if hit else 0
    assert kv.can_allocate(req, req.num_tokens - done, hit)
    kv.allocate(req, req.num_tokens - done, hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return req


def _closed_by_chains(pool: BlockPool, parents: dict) -> bool:
    """Independent of the pool's own records: parents from the requests' hash chains."""
    return all(parents[h] is None or parents[h] in pool.cached for h in pool.cached)


def _note_chain(parents: dict, req: Request) -> None:
    for i, h in enumerate(req.block_hashes):
        parents[h] = req.block_hashes[i - 1] if i else None


def test_a_block_computed_twice_leaves_an_orphan_until_its_parent_is_cached_again():
    """A and B run the same 3-block prompt side by side (no hit: both computed), so B's blocks
    are uncached copies of A's. B grows a fourth block, cached under A's third as parent.
    A ends and its blocks are evicted: B's fourth block is then an orphan and the pool is not
    closed; a later request that computes the third block again closes it."""
    pool = BlockPool(num_blocks=8)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(12)) + [99]
    a = _start(kv, "a", prompt)
    b = _start(kv, "b", prompt, use_cache=False)       # computed in the same step as A
    assert pool.prefix_closed and len(pool.cached) == 3
    b.all_token_ids.extend([5, 6, 7])                  # fills B's 4th block
    kv.allocate(b, 3)
    b.num_computed_tokens = b.num_tokens
    kv.cache_full_blocks(b)
    assert len(pool.cached) == 4 and pool.prefix_closed
    pool.drain_events()
    kv.free(a)                                         # A's 3 cached blocks become free
    filler = _start(kv, "filler", [200 + i for i in range(11)])   # takes the 3 free blocks
    assert pool.orphans == 1 and not pool.prefix_closed
    pool.check_integrity()
    kv.free(filler)
    again = _start(kv, "again", prompt[:12] + [42])   # hits nothing of A; recomputes 0..2
    assert pool.prefix_closed
    pool.check_integrity()
    for req in (b, again):
        kv.free(req)
    pool.check_integrity()


def test_event_batches_say_whether_the_device_cache_is_closed():
    from kvharbor import LLM

    llm = LLM(device="cpu", num_kv_blocks=16)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = list(range(48)) + [7]
    llm.generate([prompt, prompt], greedy)            # computed side by side
    batches = [b for b in llm.engine.drain_kv_events() if b.tier == "device"]
    assert batches and batches[-1].closed is True
    llm.engine.pool.orphans += 1                       # as if a parent had just been evicted
    llm.generate([list(range(100, 120))], greedy)
    batches = [b for b in llm.engine.drain_kv_events() if b.tier == "device"]
    assert batches and batches[-1].closed is False


def test_closure_flag_equals_a_recount_from_the_request_chains():
    """150 random walks of 50 operations: prefix families, twins computed side by side
    (duplicate blocks), appends, frees, partial cache resets and pinned-region moves.
    ``prefix_closed`` equals a recount from the requests' chains after every operation,
    and both states occur often (an unclosed pool after ~16 % of them here)."""
    states = {True: 0, False: 0}
    for seed in range(150):
        rng = random.Random(seed)
        pool = BlockPool(num_blocks=24, num_pinned=4)
        kv = KVCacheManager(pool, BS)
        live: dict[str, Request] = {}
        parents: dict = {}
        for _ in range(50):
            op, rid = rng.choice(OPS), f"r{rng.randrange(6)}"
            if op in ("new", "twin") and rid not in live:
                req = Request(rid, [int(rid[1:]) % 2] * rng.randrange(1, 25) + [rng.randrange(3)],
                              SamplingParams())
                hit = kv.get_computed_blocks(req) if op == "new" else None
                todo = req.num_tokens - (hit.num_tokens if hit else 0)
                if kv.can_allocate(req, todo, hit):
                    kv.allocate(req, todo, hit)
                    req.num_computed_tokens = req.num_tokens
                    kv.cache_full_blocks(req)
                    _note_chain(parents, req)
                    live[rid] = req
            elif op == "append" and rid in live:
                req = live[rid]
                req.all_token_ids.extend(rng.randrange(3) for _ in range(rng.randrange(1, 7)))
                todo = req.num_tokens - req.num_computed_tokens
                if kv.can_allocate(req, todo):
                    kv.allocate(req, todo)
                    req.num_computed_tokens = req.num_tokens
                    kv.cache_full_blocks(req)
                    _note_chain(parents, req)
            elif op == "free" and rid in live:
                kv.free(live.pop(rid))
            elif op == "reset":
                pool.evict_all_cached(lambda h: rng.random() < 0.5)
            elif op == "resize":
                pool.resize_pinned(rng.randrange(8))
            closed = _closed_by_chains(pool, parents)
            assert pool.prefix_closed == closed, (seed, op)
            states[closed] += 1
            pool.check_integrity()
    assert states[False] > 0.05 * sum(states.values()), states


OPS = ("new", "twin", "append", "free", "reset", "resize")
