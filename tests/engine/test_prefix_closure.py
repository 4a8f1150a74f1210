"""The pool knows whether its cache is prefix-closed (every cached block's parent cached),
and says so in each device KV event batch: a router matches closed replicas by bisection,
so a wrong "closed" would send it to the wrong replica."""

from __future__ import annotations

import random

from kvharbor.engine.block_pool import BlockPool
from kvharbor.engine.kv_cache_manager import KVCacheManager
from kvharbor.engine.request import Request, SamplingParams

from .conftest import start_request

BS = 4


def _closed_by_chains(pool: BlockPool, parents: dict) -> bool:
    """Independent of the pool's own records: parents from the requests' hash chains."""
    return all(parents[h] is None or parents[h] in pool.cached for h in pool.cached)


def _note_chain(parents: dict, req: Request) -> None:
    for i, h in enumerate(req.block_hashes):
        parents[h] = req.block_hashes[i - 1] if i else None


def test_a_copy_takes_the_place_of_an_evicted_block_so_the_chain_stays_reachable():
    """A and B run the same 3-block prompt side by side (no hit: both computed), so B's blocks
    are uncached copies of A's. B grows a fourth block, cached under A's third as parent.
    A ends and its blocks are reused: B's copies take their hashes, so no hash leaves the
    cache (no "removed" event), the pool stays closed, and a later request hits all four
    blocks, in B's blocks. Before copies were kept, B's fourth block was an orphan there."""
    pool = BlockPool(num_blocks=8)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(12)) + [99]
    a = start_request(kv, "a", prompt)
    b = start_request(kv, "b", prompt, use_cache=False)       # computed in the same step as A
    assert pool.prefix_closed and len(pool.cached) == 3
    b.all_token_ids.extend([5, 6, 7])                  # fills B's 4th block
    kv.allocate(b, 3)
    b.num_computed_tokens = b.num_tokens
    kv.cache_full_blocks(b)
    assert len(pool.cached) == 4 and pool.prefix_closed
    pool.drain_events()
    a_first = a.blocks[0]
    kv.free(a)                                         # A's 4 blocks become free, tail first
    filler = start_request(kv, "filler", [200 + i for i in range(11)])   # takes 3: A's 2nd and 3rd go
    pool.check_integrity()
    assert pool.prefix_closed and pool.orphans == 0
    held = [pool.lookup(h) for h in b.block_hashes[:4]]
    assert held[0] is a_first and held[1:] == b.blocks[1:4]
    stored, removed = pool.drain_events()
    assert removed == [] and set(stored) == set(filler.block_hashes[:2])
    kv.free(b)
    kv.free(filler)
    again = Request("again", prompt + [5, 6, 7, 1], SamplingParams())
    assert kv.get_computed_blocks(again).num_tokens == 16
    pool.check_integrity()


def test_a_copy_is_forgotten_when_its_block_is_reused_or_the_cache_is_reset():
    """A copy whose block was reused holds other contents: it must not take a hash. A reset
    that drops a hash drops its copies too (the reset asked for that prefix to go)."""
    pool = BlockPool(num_blocks=6)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(8)) + [99]                     # 2 full blocks
    a = start_request(kv, "a", prompt)
    b = start_request(kv, "b", prompt, use_cache=False)
    kv.free(b)                                         # B's copies are free, uncached
    kv.free(a)                                         # then A's blocks: queue b0 b1 b2 a0 a1 a2
    filler = start_request(kv, "f", [300 + i for i in range(8)] + [1])   # reuses B's three blocks
    pool.check_integrity()
    assert not pool._copies                            # B's blocks hold the filler now
    kv.free(filler)
    start_request(kv, "g", [400 + i for i in range(16)])      # 4 blocks: A's three go, nothing inherits
    pool.check_integrity()
    assert all(pool.lookup(h) is None for h in a.block_hashes[:2])

    pool = BlockPool(num_blocks=8)
    kv = KVCacheManager(pool, BS)
    a = start_request(kv, "a", prompt)
    b = start_request(kv, "b", prompt, use_cache=False)
    kv.free(a)
    assert pool.evict_all_cached() == 2 and not pool.cached and not pool._copies
    pool.check_integrity()
    kv.free(b)
    assert kv.get_computed_blocks(Request("c", prompt, SamplingParams())).num_tokens == 0


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
    and both states occur often (an unclosed pool after ~15 % of them here, all from
    resets). Until a walk's first reset, every full block a live request holds is reachable
    by its hash (a copy inherits the hash when the registered block goes)."""
    states = {True: 0, False: 0}
    for seed in range(150):
        rng = random.Random(seed)
        pool = BlockPool(num_blocks=24, num_pinned=4)
        kv = KVCacheManager(pool, BS)
        live: dict[str, Request] = {}
        parents: dict = {}
        reset = False
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
                reset = True
            elif op == "resize":
                pool.resize_pinned(rng.randrange(8))
            closed = _closed_by_chains(pool, parents)
            assert pool.prefix_closed == closed, (seed, op)
            states[closed] += 1
            pool.check_integrity()
            if not reset:
                for req in live.values():
                    full = req.num_computed_tokens // BS
                    assert all(h in pool.cached for h in req.block_hashes[:full]), (seed, op)
    assert states[False] > 0.05 * sum(states.values()), states


OPS = ("new", "twin", "append", "free", "reset", "resize")
