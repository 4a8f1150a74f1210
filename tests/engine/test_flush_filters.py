"""Engine.flush_cache with a scope filter drops only that scope's blocks (device and host
tier) and ends only the named tenants' sessions; other scopes stay warm."""

from __future__ import annotations

import random

import pytest

from kvharbor import LLM, SamplingParams

A, B = "tenant:a:0123456789abcdef0123456789abcdef", "tenant:b:fedcba9876543210fedcba9876543210"


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _greedy(n: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _cached(llm, prompt, tenant, salt) -> int:
    return llm.generate([prompt], _greedy(), tenant=tenant, cache_salt=salt)[0].num_cached_tokens


def test_scope_flush_drops_that_scope_on_device_and_host_only():
    llm = LLM(device="cpu", num_kv_blocks=40, host_kv_blocks=64)
    old_a, old_b, new_a, new_b, public = (_tokens(100, s) for s in (1, 2, 3, 4, 5))
    llm.generate([old_a], _greedy(), tenant="a", cache_salt=A)
    llm.generate([old_b], _greedy(), tenant="b", cache_salt=B)
    for i in range(3):                                  # pushes old_a / old_b to the host tier
        llm.generate([_tokens(300, 100 + i)], _greedy(), tenant="f", cache_salt="tenant:f")
    llm.generate([new_a], _greedy(), tenant="a", cache_salt=A)      # on the device
    llm.generate([new_b], _greedy(), tenant="b", cache_salt=B)
    llm.generate([public], _greedy(), tenant="p", cache_salt=None)
    scopes, host, pool = llm.engine.kv.scopes, llm.engine.host, llm.engine.pool
    in_host = [scopes[h] for h in host.cached]
    on_device = [scopes[h] for h in pool.cached]
    assert in_host.count(A) == in_host.count(B) == 6, in_host   # old_a, old_b: 6 full blocks each
    assert on_device.count(A) == on_device.count(B) == 6
    llm.engine.drain_kv_events()
    counts = llm.engine.flush_cache(salts=[A], tenants=["a"])
    assert (counts["device_blocks"], counts["host_blocks"]) == (6, 6), counts
    removed = [h for batch in llm.engine.drain_kv_events() for h in batch.removed]
    assert len(removed) == counts["device_blocks"] + counts["host_blocks"]
    assert _cached(llm, old_b, "b", B) == 96 and _cached(llm, new_b, "b", B) == 96
    assert _cached(llm, public, "p", None) == 96
    assert _cached(llm, old_a, "a", A) == 0 and _cached(llm, new_a, "a", A) == 0
    llm.engine.flush_cache(salts=[None], tenants=[])                # the public scope
    assert _cached(llm, public, "p", None) == 0 and _cached(llm, new_b, "b", B) == 96
    llm.check_integrity()


def test_scope_flush_ends_only_the_named_tenants_sessions():
    llm = LLM(device="cpu", num_kv_blocks=64)
    pa, pb = _tokens(100, 7), _tokens(100, 8)
    llm.generate([pa], _greedy(), tenant="a", cache_salt=A, session_id="s")
    llm.generate([pb], _greedy(), tenant="b", cache_salt=B, session_id="s")
    counts = llm.engine.flush_cache(salts=[A], tenants=["a"])
    assert counts["sessions"] == 1 and counts["device_blocks"] >= 6
    assert set(llm.engine.sessions.sessions) == {("b", "s")}
    assert _cached(llm, pb, "b", B) == 96 and _cached(llm, pa, "a", A) == 0
    llm.check_integrity()


def test_a_request_salt_is_reused_only_by_its_senders_in_the_same_scope():
    """vLLM's per-request ``cache_salt``: the same prompt hits the cache only when both the
    tenant's scope and the request's salt match; unsalted requests never reuse salted blocks."""
    llm = LLM(device="cpu", num_kv_blocks=64)
    prompt = _tokens(100, 9)

    def cached(scope, salt):
        one = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        return llm.generate(one, _greedy(), tenant="a", cache_salt=scope)[0].num_cached_tokens

    assert [cached(A, "user-1"), cached(A, "user-1"), cached(A, "user-2"), cached(A, None),
            cached(B, "user-1"), cached(None, "user-1"), cached(A, None)] == [0, 96, 0, 0, 0, 0, 96]
    with pytest.raises(ValueError, match="'cache_salt' must be a non-empty string"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": ""}, _greedy())
    llm.check_integrity()


def test_a_scope_flush_drops_the_scopes_request_salted_blocks():
    """A tenant's flush forgets its blocks whatever request salt they were cached under, and
    nothing of another scope's."""
    llm = LLM(device="cpu", num_kv_blocks=64)
    pa, pb = _tokens(100, 10), _tokens(100, 11)
    llm.generate({"prompt_token_ids": pa, "cache_salt": "user-1"}, _greedy(), tenant="a", cache_salt=A)
    llm.generate({"prompt_token_ids": pb, "cache_salt": "user-1"}, _greedy(), tenant="b", cache_salt=B)
    counts = llm.engine.flush_cache(salts=[A], tenants=["a"])
    assert counts["device_blocks"] == 6, counts
    again = [llm.generate({"prompt_token_ids": p, "cache_salt": "user-1"}, _greedy(), cache_salt=s)[0].num_cached_tokens
             for p, s in ((pa, A), (pb, B))]
    assert again == [0, 96]
    llm.check_integrity()
