"""Sessions: a conversation's blocks survive other tenants' pressure, expire, end, stay per tenant."""

from __future__ import annotations

import random

import pytest

from kvharbor import LLM, SamplingParams

BS = 16


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def llm():
    llm = LLM(device="cpu", num_kv_blocks=64, block_size=BS, session_max_blocks=40)
    llm.engine.sessions.clock = FakeClock()
    return llm


def _flood(llm: LLM, rounds: int = 6) -> None:
    """Another tenant's distinct long prompts: about 3x the cache in all."""
    for i in range(rounds):
        llm.generate([_tokens(300, 1000 + i)], _greedy(4), tenant="flood", cache_salt="tenant:flood")


def _two_turns(llm: LLM, session_id: str | None):
    first = _tokens(100, 1)
    out1 = llm.generate([first], _greedy(20), tenant="acme", cache_salt="tenant:acme", session_id=session_id)[0]
    _flood(llm)
    second = first + out1.token_ids + _tokens(20, 2)
    out2 = llm.generate([second], _greedy(8), tenant="acme", cache_salt="tenant:acme", session_id=session_id)[0]
    return first, out1, out2


def test_turn_two_reuses_turn_one_prompt_and_output_after_a_flood(llm):
    first, out1, out2 = _two_turns(llm, "chat-1")
    history = len(first) + len(out1.token_ids)
    # every full block of turn 1's prompt + output, except the last sampled token (never computed)
    assert out2.num_cached_tokens == (history - 1) // BS * BS >= 112
    llm.check_integrity()
    # the same conversation without a session is recomputed: the flood evicted it
    plain = LLM(device="cpu", num_kv_blocks=64, block_size=BS)
    _, _, cold = _two_turns(plain, None)
    assert cold.num_cached_tokens == 0
    assert cold.token_ids == out2.token_ids           # reuse does not change the greedy answer
    stats = llm.stats()
    assert stats["session_hit_tokens"] == out2.num_cached_tokens
    assert stats["sessions_active"] == 1


def test_expired_session_blocks_are_free_again(llm):
    llm.engine.set_session_limits("acme", ttl_s=30.0)
    llm.generate([_tokens(100, 3)], _greedy(10), tenant="acme", cache_salt="tenant:acme", session_id="s")
    held = llm.stats()
    assert held["session_blocks_held"] == (110 - 1) // BS
    assert held["blocks_used"] == held["session_blocks_held"]
    llm.engine.sessions.clock.now += 29.9
    assert llm.engine.expire_sessions() == 0
    llm.engine.sessions.clock.now += 0.2         # within the 0.25 s between periodic checks
    assert llm.engine.expire_sessions() == 1
    stats = llm.stats()
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == stats["blocks_total"]
    assert stats["session_blocks_held"] == 0 and stats["sessions_active"] == 0
    assert stats["session_expirations"] == 1
    assert stats["blocks_cached"] == (110 - 1) // BS     # back in the LRU, still reusable
    llm.check_integrity()


def test_engine_steps_release_sessions_past_their_ttl_without_being_asked(llm):
    """Offline (no replica calling ``expire_sessions``): any later work releases them."""
    llm.engine.set_session_limits("acme", ttl_s=30.0)
    llm.generate([_tokens(100, 3)], _greedy(10), tenant="acme", session_id="s")
    llm.engine.sessions.clock.now += 31.0
    llm.generate([_tokens(20, 4)], _greedy(2), tenant="other")
    stats = llm.stats()
    assert (stats["session_expirations"], stats["sessions_active"], stats["session_blocks_held"]) == (1, 0, 0)


def test_the_ttl_counts_from_the_end_of_the_last_turn(llm):
    """A turn that ran longer than the ttl does not leave a session that expires at once."""
    llm.engine.set_session_limits("acme", ttl_s=30.0)
    engine, clock = llm.engine, llm.engine.sessions.clock
    engine.add_request("long", _tokens(40, 12), _greedy(8), tenant="acme", session_id="s")
    engine.step()
    clock.now += 100.0                             # the turn takes 100 s
    while engine.has_unfinished():
        engine.step()
    clock.now += 29.0
    assert engine.expire_sessions() == 0
    clock.now += 2.0
    assert engine.expire_sessions() == 1


def test_a_first_turns_hit_is_not_counted_as_session_reuse(llm):
    """``session_hit_tokens`` counts what later turns reuse; a first turn that hits a prefix
    some other request cached is not the session's doing."""
    prompt = _tokens(80, 13)
    llm.generate([prompt], _greedy(4), tenant="acme")
    first = llm.generate([prompt], _greedy(4), tenant="acme", session_id="s")[0]
    assert first.num_cached_tokens == (80 - 1) // BS * BS
    assert llm.stats()["session_hit_tokens"] == 0
    assert llm.engine.sessions.describe("acme", "s")["hit_tokens"] == 0


@pytest.mark.parametrize("how", ["ended", "next turn on other history"])
def test_released_session_blocks_are_evicted_tail_first(llm, how):
    """Blocks a session lets go of return to the free queue last block first, so eviction
    pressure shortens the cached prefix from its end: the blocks not evicted stay hittable
    (evicting the first block first would leave nothing)."""
    prompt = _tokens(100, 14)
    llm.generate([prompt], _greedy(10), tenant="acme", session_id="s")     # holds 6 blocks
    if how == "ended":
        assert llm.engine.end_session("acme", "s") == 6
    else:
        llm.generate([_tokens(100, 15)], _greedy(10), tenant="acme", session_id="s")
    stats = llm.stats()
    blank = stats["blocks_free"] - (stats["blocks_cached"] - stats["blocks_used"])   # no hash
    llm.engine.drain_kv_events()
    llm.generate([_tokens((blank + 2) * BS, 16)], _greedy(1), tenant="other")
    evicted = sum(len(batch.removed) for batch in llm.engine.drain_kv_events())
    assert 2 <= evicted <= 3                   # (a turn's partial block may be freed after them)
    hit = llm.generate([prompt], _greedy(1), tenant="acme")[0].num_cached_tokens
    assert hit == (6 - evicted) * BS
    llm.check_integrity()


def test_a_stuck_engine_releases_the_oldest_session_that_holds_blocks(llm):
    """``release_oldest_idle`` frees blocks: an older idle session holding none is kept, and
    of two holding blocks the one idle longest goes first."""
    llm.generate([_tokens(10, 17)], _greedy(2), tenant="acme", session_id="short")   # no full block
    llm.generate([_tokens(70, 18)], _greedy(1), tenant="acme", session_id="long")
    llm.generate([_tokens(40, 19)], _greedy(1), tenant="acme", session_id="newer")
    sessions = llm.engine.sessions
    assert sessions.describe("acme", "short")["blocks"] == 0
    assert sessions.describe("acme", "newer")["blocks"] > 0
    assert sessions.release_oldest_idle()
    assert sessions.describe("acme", "long") is None
    assert sessions.describe("acme", "short") is not None
    assert sessions.describe("acme", "newer") is not None
    llm.check_integrity()


def test_other_tenant_same_session_id_and_text_gets_no_hit(llm):
    prompt = _tokens(80, 4)
    llm.generate([prompt], _greedy(8), tenant="a", cache_salt="tenant:a", session_id="same")
    out = llm.generate([prompt], _greedy(8), tenant="b", cache_salt="tenant:b", session_id="same")[0]
    assert out.num_cached_tokens == 0
    assert llm.stats()["sessions_active"] == 2
    assert llm.engine.end_session("b", "same") is not None
    assert llm.engine.sessions.describe("a", "same")["blocks"] == (88 - 1) // BS
    again = llm.generate([prompt], _greedy(8), tenant="a", cache_salt="tenant:a", session_id="same")[0]
    assert again.num_cached_tokens == (80 - 1) // BS * BS
    llm.check_integrity()


def test_end_session_releases_blocks_and_unknown_is_none(llm):
    llm.generate([_tokens(64, 5)], _greedy(4), tenant="acme", session_id="x")
    assert llm.stats()["blocks_used"] == (68 - 1) // BS
    assert llm.engine.end_session("acme", "x") == (68 - 1) // BS
    assert llm.stats()["blocks_used"] == 0
    assert llm.engine.end_session("acme", "x") is None
    assert llm.end_session("nope", tenant="acme") is False
    llm.check_integrity()


def test_tenant_cap_releases_oldest_idle_session_first(llm):
    llm.engine.set_session_limits("acme", max_blocks=8)        # exactly two sessions' worth
    for i, sid in enumerate(["old", "mid", "new"]):            # 4 full blocks each
        llm.engine.sessions.clock.now += 1
        llm.generate([_tokens(70, 10 + i)], _greedy(1), tenant="acme", session_id=sid)
    sessions = llm.engine.sessions
    assert sessions.describe("acme", "old") is None
    assert sessions.describe("acme", "mid")["blocks"] == 4
    assert sessions.describe("acme", "new")["blocks"] == 4
    assert sessions.num_idle_blocks["acme"] == 8              # at the cap is within it
    # another tenant's sessions do not count against acme's cap
    llm.generate([_tokens(70, 20)], _greedy(1), tenant="other", session_id="o")
    assert sessions.describe("acme", "mid") is not None
    assert sessions.blocks_by_tenant() == {"acme": 8, "other": 4}      # the per-tenant KV gauge
    llm.check_integrity()


def test_retention_never_starves_the_engine():
    llm = LLM(device="cpu", num_kv_blocks=32, block_size=BS, session_max_blocks=1000)
    for i in range(3):                          # sessions hold 3 x 6 = 18 of 32 blocks
        llm.generate([_tokens(100, 30 + i)], _greedy(1), tenant="acme", session_id=f"s{i}")
    assert llm.stats()["blocks_used"] == 18
    out = llm.generate([_tokens(400, 40)], _greedy(4), tenant="big")[0]    # needs 26 blocks
    assert len(out.token_ids) == 4
    assert llm.stats()["session_evictions"] >= 2
    llm.check_integrity()


def test_session_turn_aborted_keeps_what_it_computed(llm):
    prompt = _tokens(90, 6)
    engine = llm.engine
    engine.add_request("r1", prompt, _greedy(50), tenant="acme", session_id="ab")
    for _ in range(3):
        engine.step()
    assert engine.abort("r1")
    held = engine.sessions.describe("acme", "ab")["blocks"]
    assert held >= 90 // BS
    llm.check_integrity()
    engine.add_request("r2", prompt + [1] * 10, _greedy(1), tenant="acme", session_id="ab")
    while engine.has_unfinished():
        engine.step()
    assert engine.sessions.describe("acme", "ab")["turns"] == 2
    llm.check_integrity()


def test_bad_session_id_is_refused(llm):
    with pytest.raises(ValueError, match="session_id"):
        llm.generate([[1, 2, 3]], _greedy(1), session_id="")


def test_fork_continues_like_recomputing_without_recompute(llm):
    history_prompt = _tokens(100, 7)
    out1 = llm.generate([history_prompt], _greedy(20), tenant="acme", session_id="a")[0]
    used = llm.stats()["blocks_used"]
    assert llm.fork_session("a", "b", tenant="acme") == (120 - 1) // BS
    assert llm.stats()["blocks_used"] == used          # shared, not copied
    llm.check_integrity()
    assert llm.engine.end_session("acme", "a") is not None   # b keeps the blocks alive
    _flood(llm)
    follow = history_prompt + out1.token_ids + _tokens(12, 8)
    forked = llm.generate([follow], _greedy(10), tenant="acme", session_id="b")[0]
    assert forked.num_cached_tokens == (120 - 1) // BS * BS
    # the fork's first turn reuses the source's turns: counted as session reuse
    assert llm.engine.sessions.describe("acme", "b")["hit_tokens"] == forked.num_cached_tokens
    fresh = LLM(device="cpu", num_kv_blocks=64, block_size=BS)
    recomputed = fresh.generate([follow], _greedy(10), tenant="acme")[0]
    assert recomputed.num_cached_tokens == 0
    assert forked.token_ids == recomputed.token_ids
    with pytest.raises(ValueError, match="already exists"):
        llm.fork_session("b", "b", tenant="acme")
    with pytest.raises(ValueError, match="no session"):
        llm.fork_session("missing", "c", tenant="acme")
    llm.check_integrity()


def test_flush_makes_the_next_identical_request_cold_and_ends_sessions():
    llm = LLM(device="cpu", num_kv_blocks=64, block_size=BS, host_kv_blocks=32)
    prompt = _tokens(100, 9)
    first = llm.generate([prompt], _greedy(4), tenant="acme", session_id="s")[0]
    _flood(llm)                             # evicted flood blocks move to the host tier
    warm = llm.generate([prompt], _greedy(4), tenant="acme")[0]
    assert warm.num_cached_tokens == 96
    llm.engine.drain_kv_events()
    counts = llm.engine.flush_cache()
    assert counts["sessions"] == 1 and counts["device_blocks"] > 0 and counts["host_blocks"] > 0
    removed = [h for batch in llm.engine.drain_kv_events() for h in batch.removed]
    assert len(removed) == counts["device_blocks"] + counts["host_blocks"]
    cold = llm.generate([prompt], _greedy(4), tenant="acme")[0]
    assert cold.num_cached_tokens == 0 and cold.token_ids == first.token_ids
    stats = llm.stats()
    assert stats["sessions_active"] == 0 and stats["host_blocks_used"] <= (104 - 1) // BS
    llm.check_integrity()


def test_pinned_class_sessions_hold_pinned_region_blocks():
    llm = LLM(device="cpu", num_kv_blocks=64, block_size=BS, pinned_kv_blocks=16)
    llm.generate([_tokens(100, 11)], _greedy(10), tenant="acme", qos="premium", session_id="p")
    held = llm.engine.sessions.sessions[("acme", "p")].blocks
    assert len(held) == (110 - 1) // BS and all(b.region == "pinned" for b in held)
    assert llm.stats()["pinned_blocks_used"] == len(held)
    _flood(llm)                                     # shared-class pressure cannot touch them
    assert llm.stats()["pinned_blocks_used"] == len(held)
    llm.check_integrity()
