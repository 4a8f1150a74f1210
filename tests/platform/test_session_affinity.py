"""Session affinity: a session's turns go to the replica that holds it, within the load guard."""

from __future__ import annotations

from kvharbor.actors.prefix_directory import MatchInfo
from kvharbor.platform.protocol import session_key
from kvharbor.platform.routing_policy import Candidate, KVAwarePolicy, RouteRequest
from tests.platform.test_router_unit import (HASHES, FakeReplica, FakeShard, make_router, md,
                                             route, routed, uids)

BS = 16
SESSION = RouteRequest(prompt_tokens=1024, block_size=BS, session_id="chat-1")


def cand(rid: str, blocks: int = 0, load: int = 0, holds: bool = False) -> Candidate:
    match = MatchInfo(blocks, blocks, 0) if blocks else None
    return Candidate(rid, match, {}, in_flight=load, holds_session=holds)


def order(request, candidates) -> list[str]:
    return [r.replica_id for r in KVAwarePolicy().rank(request, candidates)]


def test_holder_ranks_first_over_a_longer_prefix_hit():
    assert order(SESSION, [cand("hit", blocks=60), cand("holder", blocks=10, holds=True)])[0] == "holder"


def test_an_overloaded_holder_loses_to_the_others():
    ranked = order(SESSION, [cand("holder", load=9, holds=True), cand("a", load=1), cand("b", load=1)])
    assert ranked[-1] == "holder"


def test_without_a_session_id_holding_means_nothing():
    plain = RouteRequest(prompt_tokens=1024, block_size=BS)
    assert order(plain, [cand("hit", blocks=60), cand("holder", blocks=10, holds=True)])[0] == "hit"


def _router_with_prefix_on_b():
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=HASHES)       # the prefix index prefers b
    return make_router(shard)


def test_router_sends_later_turns_where_the_session_went_and_falls_back_when_it_is_gone():
    router = _router_with_prefix_on_b()
    replicas = {x: FakeReplica(x) for x in "abc"}
    ranks, pr = route(router, list(replicas.values()), session_id="chat-1", rid="t1")
    assert uids(ranks)[0] == ["b"] and md(pr)["router_session_affinity"] is False
    routed(router, pr, replicas["c"])                 # Serve took a lower rank: c holds it now
    ranks, pr = route(router, list(replicas.values()), session_id="chat-1", rid="t2")
    assert uids(ranks)[0] == ["c"] and md(pr)["router_session_affinity"] is True
    # another session of the same tenant is not pulled to c
    ranks, _ = route(router, list(replicas.values()), session_id="chat-2", rid="t3")
    assert uids(ranks)[0] == ["b"]
    # c is gone: the prefix index decides as for any request
    ranks, pr = route(router, [replicas["a"], replicas["b"]], session_id="chat-1", rid="t4")
    assert uids(ranks)[0] == ["b"] and md(pr)["router_session_affinity"] is False


def test_a_turn_without_block_hashes_still_goes_where_its_session_is():
    """Power of two decides a request with no prefix to match (no block hashes), but not a
    session's turn: that goes to the replica holding the session, every time."""
    router = _router_with_prefix_on_b()
    replicas = {x: FakeReplica(x) for x in "abcd"}
    ranks, pr = route(router, list(replicas.values()), session_id="chat-1", rid="t1")
    routed(router, pr, replicas["c"])
    for i in range(12):
        ranks, pr = route(router, list(replicas.values()), session_id="chat-1", rid=f"t{i + 2}", hashes=[])
        assert uids(ranks)[0] == ["c"], uids(ranks)
        assert md(pr)["router_session_affinity"] is True and md(pr)["router_policy"] == "pow2_fallback"


def test_sessions_reported_by_replicas_are_found_and_scoped_per_tenant():
    router = _router_with_prefix_on_b()
    held = FakeReplica("a", sessions=[session_key("acme", "s1")])
    replicas = [held, FakeReplica("b"), FakeReplica("c")]
    ranks, _ = route(router, replicas, session_id="s1")       # pending() sends tenant "acme"
    assert uids(ranks)[0] == ["a"]
    ranks, _ = route(router, replicas, session_id="s1", tenant="globex")
    assert uids(ranks)[0] == ["b"]


def test_load_guard_applies_to_a_reported_holder():
    router = _router_with_prefix_on_b()
    busy = FakeReplica("a", sessions=[session_key("acme", "s1")], num_running=12)
    ranks, _ = route(router, [busy, FakeReplica("b"), FakeReplica("c")], session_id="s1")
    assert uids(ranks)[0] != ["a"]


def test_a_session_a_replica_reports_later_is_found_in_its_next_stats():
    """The router caches each replica's reported session keys by stats report: a new report
    that lists a session it did not list before is read again."""
    router = _router_with_prefix_on_b()
    a = FakeReplica("a", sessions=[])
    replicas = [a, FakeReplica("b"), FakeReplica("c")]
    ranks, _ = route(router, replicas, session_id="s1", rid="t1")
    assert uids(ranks)[0] == ["b"]
    a.routing_stats = {**a.routing_stats, "sessions": [session_key("acme", "s1")]}
    ranks, _ = route(router, replicas, session_id="s1", rid="t2")
    assert uids(ranks)[0] == ["a"]
