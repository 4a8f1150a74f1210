"""Prefix caching: reuse across requests, isolation across cache salts."""

from __future__ import annotations

import random

from kvharbor import LLM, SamplingParams

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
    llm = LLM(device="cpu", num_kv_blocks=40)
    old, new = _tokens(320, 6), _tokens(320, 7)
    llm.generate([old], GREEDY)
    llm.generate([new], GREEDY)          # needs most of the cache: evicts `old` first
    again = llm.generate([new], GREEDY)[0]
    assert again.num_cached_tokens >= 304
    assert llm.stats()["evictions"] > 0
    llm.check_integrity()
