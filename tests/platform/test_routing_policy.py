"""Routing policies: cache affinity, load penalty, balance guard, pinned and QoS handling."""

from __future__ import annotations

import random

from kvharbor.actors.prefix_directory import MatchInfo
from kvharbor.platform.routing_policy import (Candidate, KVAwarePolicy, PowerOfTwoPolicy,
                                              RoundRobinPolicy, RouteRequest, displaced_blocks)

BS = 16
REQ = RouteRequest(prompt_tokens=6016, block_size=BS)       # 376 blocks


def dev(n: int) -> MatchInfo:
    return MatchInfo(n, n, 0)


def cand(rid: str, match: MatchInfo | None = None, load: int = 0, **stats) -> Candidate:
    return Candidate(rid, match, stats, in_flight=load)


def first(policy, request, candidates) -> str:
    return policy.rank(request, candidates)[0].replica_id


def test_longest_cached_prefix_wins_at_equal_load():
    ranked = KVAwarePolicy().rank(REQ, [cand("a", dev(10)), cand("b", dev(300)), cand("c")])
    assert [r.replica_id for r in ranked] == ["b", "a", "c"]
    assert ranked[0].predicted_cached_tokens == 300 * BS
    assert ranked[2].predicted_cached_tokens == 0


def test_host_hits_count_below_device_hits():
    policy = KVAwarePolicy(host_hit_weight=0.5)
    assert first(policy, REQ, [cand("host", MatchInfo(10, 0, 10)), cand("dev", dev(10))]) == "dev"
    # 20 host blocks (worth 10 device blocks) beat 8 device blocks
    assert first(policy, REQ, [cand("host", MatchInfo(20, 0, 20)), cand("dev", dev(8))]) == "host"


def test_predicted_tokens_never_exceed_the_prompt():
    small = RouteRequest(prompt_tokens=40, block_size=BS)
    ranked = KVAwarePolicy().rank(small, [cand("a", dev(2))])
    assert ranked[0].predicted_cached_tokens == 32
    ranked = KVAwarePolicy().rank(RouteRequest(prompt_tokens=20, block_size=BS),
                                  [cand("a", dev(9))])        # stale/oversized match info
    assert ranked[0].predicted_cached_tokens == 20


def test_load_penalty_outweighs_a_small_hit():
    policy = KVAwarePolicy(load_cost_tokens=512)
    # 4 cached blocks (64 tokens) are not worth waiting behind 1 more request
    assert first(policy, REQ, [cand("hit", dev(4), load=1), cand("idle", load=0)]) == "idle"
    # a whole cached system prompt is
    assert first(policy, REQ, [cand("hit", dev(375), load=1), cand("idle", load=0)]) == "hit"


def test_no_matches_go_to_the_least_loaded_and_equal_replicas_take_turns():
    policy = KVAwarePolicy()
    assert first(policy, REQ, [cand("a", load=3), cand("b", load=1), cand("c", load=2)]) == "b"
    winners = [first(policy, REQ, [cand("a"), cand("b"), cand("c")]) for _ in range(6)]
    assert sorted(winners[:3]) == ["a", "b", "c"] and winners[3:] == winners[:3]


def test_much_more_loaded_hot_replica_is_ranked_after_the_others():
    policy = KVAwarePolicy(imbalance_tolerance=0.1, balance_slack=2)
    cands = [cand("hot", dev(375), load=20), cand("x", load=5), cand("y", dev(100), load=6)]
    ranked = policy.rank(REQ, cands)
    assert [r.replica_id for r in ranked] == ["y", "x", "hot"]
    assert ranked[-1].overloaded and not ranked[0].overloaded
    # slightly above the mean (within the slack) keeps its affinity
    cands = [cand("hot", dev(375), load=6), cand("x", load=5), cand("y", load=5)]
    assert first(policy, REQ, cands) == "hot"


def test_a_replica_is_overloaded_only_when_above_the_mean_and_the_slack_both():
    """More than ``balance_slack`` above the least loaded but within the tolerance of the
    mean (loads 10, 10, 10, 7: mean 9.25) is not overloaded: the cached prefix still wins."""
    policy = KVAwarePolicy(imbalance_tolerance=0.15, balance_slack=2, load_cost_tokens=0)
    cands = [cand("hot", dev(375), load=10), cand("x", load=10), cand("y", load=10), cand("low", load=7)]
    ranked = policy.rank(REQ, cands)
    assert ranked[0].replica_id == "hot" and not any(r.overloaded for r in ranked)


def test_a_replica_exactly_at_either_bound_of_the_guard_is_not_overloaded():
    """Overloaded means *above* (1 + tolerance) x the mean load and *more than*
    ``balance_slack`` above the least loaded: a replica exactly at either bound keeps its
    cached prefix; one request more and it is ranked last."""
    policy = KVAwarePolicy(imbalance_tolerance=0.25, balance_slack=2, load_cost_tokens=0)

    def rank(hot_load: int, others: list[int]):
        cands = [cand("hot", dev(375), load=hot_load)]
        cands += [cand(f"r{i}", load=n) for i, n in enumerate(others)]
        return policy.rank(REQ, cands)

    at_slack = rank(2, [0, 0])              # mean 0.67: above the tolerance, at the slack
    assert at_slack[0].replica_id == "hot" and not any(r.overloaded for r in at_slack)
    at_limit = rank(5, [5, 5, 1])           # mean 4, limit exactly 5.0; 4 above the least
    assert at_limit[0].replica_id == "hot" and not any(r.overloaded for r in at_limit)
    for over in (rank(3, [0, 0]), rank(6, [5, 5, 1])):
        assert over[-1].replica_id == "hot" and over[-1].overloaded


def test_session_affinity_yields_to_the_balance_guard():
    """A session's replica ranks first, unless it is overloaded: then the guard wins."""
    policy = KVAwarePolicy(imbalance_tolerance=0.1, balance_slack=2)
    turn = RouteRequest(prompt_tokens=6016, block_size=BS, session_id="s1")
    home = Candidate("home", None, {}, in_flight=2, holds_session=True)
    assert first(policy, turn, [home, cand("x", dev(300), load=2)]) == "home"
    busy = Candidate("home", None, {}, in_flight=20, holds_session=True)
    ranked = policy.rank(turn, [busy, cand("x", load=2), cand("y", load=3)])
    assert ranked[-1].replica_id == "home" and ranked[-1].overloaded and not ranked[-1].session


def test_hot_prefix_spreads_instead_of_taking_all_traffic():
    """All requests share one prefix that only replica r0 holds; loads never drain."""
    policy = KVAwarePolicy()
    loads = dict.fromkeys(["r0", "r1", "r2", "r3"], 0)
    for _ in range(400):
        cands = [cand(r, dev(375) if r == "r0" else None, load=n) for r, n in loads.items()]
        loads[first(policy, REQ, cands)] += 1
    mean = sum(loads.values()) / len(loads)
    assert max(loads.values()) / mean <= 1.15
    assert loads["r0"] == max(loads.values())            # affinity kept up to the bound


def test_prefill_sent_and_not_yet_confirmed_counts_against_a_replica():
    """Blocks this router just sent to a replica (no KV event yet) are work it still has
    ahead: at equal load and no cached prefix, the replica without that backlog goes first."""
    policy = KVAwarePolicy()
    busy = Candidate("busy", None, {}, in_flight=1, active_blocks=300)
    idle = Candidate("idle", None, {}, in_flight=1)
    assert first(policy, REQ, [busy, idle]) == "idle"


def test_replica_without_room_for_the_request_is_penalized():
    policy = KVAwarePolicy()
    full = cand("full", free_shared_blocks=10, total_blocks=4096)
    roomy = cand("roomy", free_shared_blocks=2000, total_blocks=4096)
    assert first(policy, REQ, [full, roomy]) == "roomy"
    # stats not reported yet: no penalty, fall back to load
    assert first(policy, REQ, [cand("new", load=0), cand("busy", load=1)]) == "new"


def test_a_new_prefix_goes_to_empty_cache_rather_than_evicting_for_a_one_block_hit():
    """Free blocks count cached (evictable) ones: a replica full of other tenants' prefixes
    and one that is empty both report 800. A prompt sharing one leading block (a template)
    with the full one must still go to the empty one, not evict 375 blocks for a 16-token hit."""
    full = cand("full", dev(1), free_shared_blocks=800, empty_shared_blocks=0, shared_blocks=800)
    empty = cand("empty", None, free_shared_blocks=800, empty_shared_blocks=800, shared_blocks=800)
    assert first(KVAwarePolicy(), REQ, [full, empty]) == "empty"
    assert first(KVAwarePolicy(evict_cost=0.0), REQ, [full, empty]) == "full"    # the old rule
    # a real hit still wins: 300 cached blocks outweigh 76 displaced ones
    assert first(KVAwarePolicy(), REQ, [cand("full", dev(300), free_shared_blocks=800, empty_shared_blocks=0,
                                             shared_blocks=800), empty]) == "full"
    # replicas that do not report empty blocks: no penalty
    assert first(KVAwarePolicy(), REQ, [cand("old", dev(1), free_shared_blocks=800), empty]) == "old"


def test_new_prefixes_fill_the_replicas_evenly_not_one_after_the_other():
    """24 tenants' 98-block prompts that share one template block, placed one by one on 4
    idle replicas of 800 blocks: every replica ends with 6 (charging only the blocks beyond
    the empty ones gave 8/8/8/0: a replica with room left took every tenant for its
    one-block hit until it was full)."""
    request = RouteRequest(prompt_tokens=98 * BS, block_size=BS)
    empty, tenants = {r: 800 for r in "abcd"}, {r: 0 for r in "abcd"}
    policy = KVAwarePolicy()
    for _ in range(24):
        pick = first(policy, request, [cand(r, dev(1) if tenants[r] else None, free_shared_blocks=800,
                                            empty_shared_blocks=empty[r], shared_blocks=800)
                                       for r in "abcd"])
        tenants[pick] += 1
        empty[pick] = max(0, empty[pick] - 97)
    assert sorted(tenants.values()) == [6, 6, 6, 6], tenants


def test_displaced_blocks_are_those_beyond_the_empty_ones_or_the_occupied_share():
    """What a request evicts at a replica: the blocks it needs beyond the empty ones, or its
    needed blocks x the occupied share of the shared region when that is more; a replica
    reporting no shared region (every block pinned) displaces the blocks beyond its empty
    ones; one that does not report its empty blocks, nothing."""
    assert displaced_blocks({"empty_shared_blocks": 500, "shared_blocks": 800}, 376) == 141.0
    assert displaced_blocks({"empty_shared_blocks": 10, "shared_blocks": 100}, 376) == 366.0
    assert displaced_blocks({"empty_shared_blocks": 10, "shared_blocks": 0}, 376) == 366.0
    assert displaced_blocks({"empty_shared_blocks": 10}, 376) == 366.0
    assert displaced_blocks({"empty_shared_blocks": 400}, 376) == 0.0
    assert displaced_blocks({"shared_blocks": 800}, 376) == 0.0
    assert displaced_blocks({"empty_shared_blocks": 0, "shared_blocks": 800}, 0) == 0.0


def test_pinned_requests_prefer_free_pinned_blocks():
    policy = KVAwarePolicy()
    no_pin = cand("no_pin", free_shared_blocks=2000, free_pinned_blocks=0)
    pin = cand("pin", free_shared_blocks=2000, free_pinned_blocks=500)
    pinned = RouteRequest(prompt_tokens=6016, block_size=BS, pinned=True, priority=2)
    assert all(first(policy, pinned, [no_pin, pin]) == "pin" for _ in range(20))
    plain = {first(policy, REQ, [no_pin, pin]) for _ in range(40)}
    assert plain == {"no_pin", "pin"}                    # unpinned requests don't care


def test_a_pinned_request_counts_free_pinned_blocks_as_room():
    """Room for a pinned request is free shared plus free pinned blocks: a replica with no
    shared block free but its pinned region free has room, and beats one without a region."""
    policy = KVAwarePolicy()
    pinned = RouteRequest(prompt_tokens=160, block_size=BS, pinned=True, priority=2)  # 10 blocks
    region = cand("region", free_shared_blocks=0, free_pinned_blocks=20)
    shared = cand("shared", free_shared_blocks=20, free_pinned_blocks=0)
    assert all(first(policy, pinned, [shared, region]) == "region" for _ in range(10))
    assert policy.score(pinned, region, 0) == 0.0


def test_a_hit_saves_at_most_the_prompt():
    """A match longer than the prompt (a stale or oversized answer) saves the prompt, no more."""
    policy = KVAwarePolicy(evict_cost=0.0)
    small = RouteRequest(prompt_tokens=20, block_size=BS)
    assert policy.score(small, cand("a", dev(9)), 0) == 20.0


def test_lower_priority_queues_do_not_count_against_higher_priority_requests():
    policy = KVAwarePolicy()
    batchy = cand("batchy", load=3, num_running=0, num_waiting=3, queue_by_priority={0: 3})
    premy = cand("premy", load=2, num_running=0, num_waiting=2, queue_by_priority={2: 2})
    premium = RouteRequest(prompt_tokens=6016, block_size=BS, priority=2, qos="premium")
    batch = RouteRequest(prompt_tokens=6016, block_size=BS, priority=0, qos="batch")
    assert first(policy, premium, [batchy, premy]) == "batchy"
    assert first(policy, batch, [batchy, premy]) == "premy"


def test_stats_are_the_load_when_the_router_has_no_in_flight_count():
    a = Candidate("a", None, {"num_running": 4, "num_waiting": 3})
    b = Candidate("b", None, {"num_running": 2, "num_waiting": 0})
    assert first(KVAwarePolicy(), REQ, [a, b]) == "b"


def test_equal_replicas_keep_taking_turns_while_replicas_come_and_go():
    """Who was ranked first when is remembered per replica and forgotten for replicas that
    left (bounded however many come and go); the live ones' turns survive the forgetting."""
    policy = KVAwarePolicy()
    live = [cand("a"), cand("b"), cand("c")]
    turns = [first(policy, REQ, live) for _ in range(2)]
    for i in range(300):                     # each new replica wins once with its prefix
        assert first(policy, REQ, live + [cand(f"gone{i}", dev(10))]) == f"gone{i}"
    assert len(policy._first_at) <= 4 * 4 + 64
    never_first = [x for x in "abc" if x not in turns]
    assert [first(policy, REQ, live) for _ in range(3)] == never_first + turns


def test_power_of_two_never_puts_the_most_loaded_first():
    policy = PowerOfTwoPolicy(random.Random(5))
    cands = [cand("a", load=0), cand("b", load=5), cand("c", load=9)]
    firsts = set()
    for _ in range(100):
        ranked = policy.rank(REQ, cands)
        assert sorted(r.replica_id for r in ranked) == ["a", "b", "c"]
        firsts.add(ranked[0].replica_id)
    assert firsts == {"a", "b"}


def test_round_robin_rotates_through_all_replicas():
    policy = RoundRobinPolicy()
    cands = [cand("a", dev(100)), cand("b"), cand("c")]
    assert [first(policy, REQ, cands) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_every_policy_ranks_each_candidate_once_and_handles_empty_input():
    cands = [cand(f"r{i}", dev(i), load=i % 3) for i in range(7)]
    for policy in (KVAwarePolicy(), PowerOfTwoPolicy(), RoundRobinPolicy()):
        assert sorted(r.replica_id for r in policy.rank(REQ, cands)) == sorted(
            c.replica_id for c in cands)
        assert policy.rank(REQ, []) == []


def test_a_request_ahead_computing_the_prompts_prefix_is_not_a_queue():
    """The second copy of a burst of one 400-token prompt: the replica computing the first
    copy (one request ahead, its 25 blocks sent and unconfirmed) wins over an idle replica
    holding nothing; the same replica with the same blocks *not* pending (another request
    ahead) loses, and a third copy (two ahead) spills."""
    burst = RouteRequest(prompt_tokens=400, block_size=BS)
    idle = cand("idle")

    def computing(ahead: int, pending: bool = True) -> Candidate:
        return Candidate("hot", dev(25), {}, in_flight=ahead, active_blocks=25, pending_hit=pending)

    policy = KVAwarePolicy()
    assert first(policy, burst, [idle, computing(1)]) == "hot"          # 400 - 100 > 0
    assert first(policy, burst, [idle, computing(1, pending=False)]) == "idle"   # 400 - 512 - 100
    assert first(policy, burst, [idle, computing(2)]) == "idle"
    # never fewer than no request ahead: an idle replica with the prefix cached beats one still
    # computing it whose in-flight count has not caught up with the send yet (0)
    assert first(policy, burst, [cand("cached", dev(25)), computing(0)]) == "cached"
