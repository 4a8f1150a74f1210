"""Prefix caching: reuse across requests, isolation across cache salts."""

from __future__ import annotations

import random

from kvharbor import LLM, SamplingParams
from kvharbor.engine.hashing import hash_prompt_blocks

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_second_request_reuses_256_token_prefix():
    llm = LLM(device="cpu", num_kv_blocks=256)
    prefix = _tokens(256, 1)
    first = llm.generate([prefix + _tokens(20, 2)], GREEDY)[0]
    second = llm.generate([prefix + _tokens(20, 3)], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 240
    cold = LLM(device="cpu", num_kv_blocks=256).generate([prefix + _tokens(20, 3)], GREEDY)[0]
    assert second.token_ids == cold.token_ids
    llm.check_integrity()


def test_identical_prompt_is_cached_up_to_last_block():
    llm = LLM(device="cpu", num_kv_blocks=256)
    prompt = _tokens(100, 4)
    a = llm.generate([prompt], GREEDY)[0]
    b = llm.generate([prompt], GREEDY)[0]
    assert b.num_cached_tokens == 96          # 6 full blocks; the last token is recomputed
    assert a.token_ids == b.token_ids


def test_different_cache_salt_never_hits():
    llm = LLM(device="cpu", num_kv_blocks=256)
    prompt = _tokens(300, 5)
    a = llm.generate([prompt], GREEDY, tenant="a", cache_salt="tenant:a")[0]
    b = llm.generate([prompt], GREEDY, tenant="b", cache_salt="tenant:b")[0]
    again = llm.generate([prompt], GREEDY, tenant="a", cache_salt="tenant:a")[0]
    assert b.num_cached_tokens == 0
    assert again.num_cached_tokens >= 288
    assert a.token_ids == b.token_ids == again.token_ids


def test_lru_evicts_oldest_prefix_first():
    """Four 8-block prefixes run one after another, then a fifth needs 9 blocks: the 4 never
    used blocks go first, then only the *oldest* prefix (A) loses blocks; B, C, D stay whole.
    (An MRU or random order would take D's or any prefix's blocks.)"""
    llm = LLM(device="cpu", num_kv_blocks=40)
    prompts = [_tokens(128, seed) for seed in (6, 7, 8, 9, 10)]     # A, B, C, D, E
    for p in prompts[:4]:
        llm.generate([p], GREEDY)
    llm.generate([prompts[4]], GREEDY)
    cached = llm.engine.pool.cached
    held = [sum(h in cached for h in hash_prompt_blocks(p, 16, parent=llm.engine.hash_root)) for p in prompts[:4]]
    assert held[1:] == [8, 8, 8], held
    assert held[0] < 8, held
    assert llm.stats()["evictions"] == 8 - held[0]
    llm.check_integrity()

def test_blocks_recomputed_after_a_preemption_are_cached_again():
    """A batch request is preempted after its 80-token prompt (5 blocks) and 4 tokens; the
    premium request that took its seat evicts its last three prompt blocks. On its return the
    request reuses the first two and recomputes the other three, which must go back into the
    prefix cache: the same prompt then hits 4 blocks (all but the last token's), and every
    cached block's parent is cached. Before: its registration cursor still pointed past them,
    so they were skipped (32 tokens hit, the later block an orphan)."""
    llm = LLM(device="cpu", num_kv_blocks=10, max_num_seqs=1)
    e, prompt = llm.engine, _tokens(80, 31)
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    batch = e.add_request("batch", prompt, sp, qos="batch")
    while batch.num_computed_tokens < 84:
        e.step()
    e.add_request("premium", _tokens(120, 32), SamplingParams(max_tokens=2, ignore_eos=True), qos="premium")
    done = {}
    while e.has_unfinished():
        done.update({o.request_id: o for o in e.step() if o.finished})
        e.check_integrity()
    assert batch.num_preemptions == 1 and e.stats()["evictions"] >= 3
    # its usage reports the cache hits of its first schedule (none), not of its return (32)
    assert done["batch"].num_cached_tokens == 0 and len(done["batch"].token_ids) == 20
    assert e.kv.pool.prefix_closed
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 64


def test_pinning_a_cached_prefix_pins_the_blocks_lookups_find():
    """The prefix was cached by a request, so pinning it reuses its first block and recomputes
    the last (a copy under the same hash): the cached blocks are the ones pinned, no copy stays
    held, and a request reading the prefix counts both as free room."""
    llm = LLM(device="cpu", num_kv_blocks=8)
    engine = llm.engine
    prompt = list(range(40, 80))
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert engine.pin_prefix(prompt[:32], qos="standard") == 2
    hashes = hash_prompt_blocks(prompt, 16, None, parent=engine.hash_root)[:2]
    assert [engine.pool.lookup(h).pin_cnt for h in hashes] == [1, 1]
    assert engine.pool.num_free(False) == 8 - 2
    out = llm.generate([prompt], SamplingParams(max_tokens=8 * 16 - 40, temperature=0, ignore_eos=True))[0]
    assert out.num_cached_tokens == 32 and len(out.token_ids) == 8 * 16 - 40
    engine.check_integrity()
    # a pinned class pins what it may read: the shared blocks a standard request cached
    llm = LLM(device="cpu", num_kv_blocks=16, pinned_kv_blocks=4)
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert llm.engine.pin_prefix(prompt[:32], qos="premium") == 2
    assert [llm.engine.pool.lookup(h).pin_cnt for h in hashes] == [1, 1]
    llm.engine.check_integrity()
    # and the pinned-region blocks a premium request cached
    llm = LLM(device="cpu", num_kv_blocks=16, pinned_kv_blocks=4)
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), qos="premium")
    assert llm.engine.pin_prefix(prompt[:32], qos="premium") == 2
    assert [llm.engine.pool.lookup(h).pin_cnt for h in hashes] == [1, 1]
    llm.engine.check_integrity()
