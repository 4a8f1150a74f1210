"""OpenAI's ``prompt_cache_key``: requests of one tenant sending one key go to that key's home
replica (a rendezvous hash every router agrees on), within the load guard, unless another
replica holds more of the prompt; ``prompt_cache_retention`` accepts only "in_memory"."""

from __future__ import annotations

import random
import uuid

import openai
import pytest

from kvharbor.actors.prefix_directory import MatchInfo
from kvharbor.platform.protocol import session_key
from kvharbor.platform.routing_policy import Candidate, KVAwarePolicy, RouteRequest, key_weight
from tests.conftest import DEMO
from tests.platform.test_router_unit import FakeReplica, FakeShard, make_router, md, route, routed, uids

BS = 16


def keyed(key: str | None, session: str | None = None) -> RouteRequest:
    return RouteRequest(prompt_tokens=1024, block_size=BS, session_id=session, cache_key=key)


def cand(rid: str, blocks: int = 0, load: int = 0, holds: bool = False) -> Candidate:
    match = MatchInfo(blocks, blocks, 0) if blocks else None
    return Candidate(rid, match, {}, in_flight=load, holds_session=holds)


def order(request, candidates) -> list[str]:
    return [r.replica_id for r in KVAwarePolicy().rank(request, candidates)]


def home(key: str, rids) -> str:
    return max(rids, key=lambda rid: key_weight(key, rid))


def test_the_keys_home_ranks_first_over_a_less_loaded_replica():
    rids = ["a", "b", "c", "d"]
    for key in (f"k{i}" for i in range(16)):
        h = home(key, rids)
        cands = [cand(r, load=1 if r == h else 0) for r in rids]     # within the load guard
        assert order(keyed(key), cands)[0] == h
        assert order(keyed(None), cands)[0] != h                     # without a key: the idle ones


def test_every_router_picks_the_same_home_and_keys_spread_over_the_replicas():
    rids = [f"r{i}" for i in range(4)]
    homes = {}
    for key in (f"k{i}" for i in range(64)):
        shuffled = [cand(r) for r in random.Random(key).sample(rids, len(rids))]
        firsts = {order(keyed(key), shuffled)[0], order(keyed(key), [cand(r) for r in rids])[0]}
        assert len(firsts) == 1, key                  # candidate order and policy state do not matter
        homes[key] = firsts.pop()
    assert all(8 <= list(homes.values()).count(r) <= 24 for r in rids), homes


def test_an_overloaded_home_spills_to_the_keys_next_home():
    rids = ["a", "b", "c", "d"]
    key = "agent-7"
    h = home(key, rids)
    second = home(key, [r for r in rids if r != h])
    cands = [cand(r, load=9 if r == h else 1) for r in rids]
    ranked = order(keyed(key), cands)
    assert ranked[0] == second and ranked[-1] == h


def test_a_replica_holding_more_of_the_prompt_wins_over_the_home():
    rids = ["a", "b", "c"]
    key = "agent-1"
    h = home(key, rids)
    other = next(r for r in rids if r != h)
    cands = [cand(r, blocks=20 if r == other else 4 if r == h else 0) for r in rids]
    assert order(keyed(key), cands)[0] == other
    cands = [cand(r, blocks=20 if r in (h, other) else 0, load=1 if r == h else 0) for r in rids]
    assert order(keyed(key), cands)[0] == h             # as much as the best: the home


def test_a_session_holder_beats_the_keys_home():
    rids = ["a", "b", "c"]
    key = "agent-1"
    holder = next(r for r in rids if r != home(key, rids))
    cands = [cand(r, holds=r == holder) for r in rids]
    assert order(keyed(key, session="chat-1"), cands)[0] == holder


def test_a_departing_replica_moves_only_the_keys_it_was_home_to():
    rids = [f"r{i}" for i in range(5)]
    keys = [f"k{i}" for i in range(100)]
    before = {k: home(k, rids) for k in keys}
    after = {k: home(k, rids[:-1]) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "r4"} and moved


def test_two_routers_send_a_keys_requests_to_one_replica_even_without_block_hashes():
    """Each gateway replica has its own router: both agree on a key's home with nothing shared,
    also when the prompt has no full block to match (power of two would scatter it)."""
    replicas = [FakeReplica(x) for x in "abcd"]
    expected = home(session_key("acme", "agent-42"), "abcd")
    for router in (make_router(FakeShard()), make_router(FakeShard())):
        for i in range(6):
            ranks, pr = route(router, replicas, rid=f"q{i}", hashes=[], prompt_cache_key="agent-42")
            assert uids(ranks)[0] == [expected]
            assert md(pr)["router_cache_key_affinity"] is True
    ranks, pr = route(make_router(FakeShard()), replicas, rid="plain", hashes=[])
    assert md(pr)["router_cache_key_affinity"] is False


def test_a_key_is_scoped_to_its_tenant_and_a_longer_prefix_wins_over_it():
    replicas = {x: FakeReplica(x) for x in "abcd"}
    key = next(k for k in (f"k{i}" for i in range(100))
               if home(session_key("acme", k), "abcd") != home(session_key("globex", k), "abcd"))
    router = make_router(FakeShard())
    ranks, pr = route(router, list(replicas.values()), rid="t1", prompt_cache_key=key)
    first = uids(ranks)[0]
    assert first == [home(session_key("acme", key), "abcd")]
    routed(router, pr, replicas[first[0]])
    # another tenant's key of the same name has its own home (its prompt hashes differ: salted)
    ranks, _ = route(router, list(replicas.values()), rid="t2", prompt_cache_key=key, tenant="globex",
                     hashes=[])
    assert uids(ranks)[0] == [home(session_key("globex", key), "abcd")]
    # a request of another key whose prompt was just sent to acme's home follows its prefix there
    ranks, pr = route(router, list(replicas.values()), rid="t3", prompt_cache_key="other-key")
    assert uids(ranks)[0] == first and md(pr)["router_cache_key_affinity"] is (
        home(session_key("acme", "other-key"), "abcd") == first[0])


# ---- through HTTP ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def standard(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


def test_requests_with_one_key_are_served_by_that_keys_home_replica(standard, kvharbor_app):
    """Two gateways, two LLM replicas: every request of a key, whichever gateway routes it, is
    served by the replica the key's rendezvous hash names (each prompt starts with a word of
    its own, so no replica holds more of it than another)."""
    served: dict[str, set[str]] = {}
    for i in range(24):
        key = f"agent-{i % 12}"
        answer = standard.completions.create(model=kvharbor_app.model, prompt=f"{uuid.uuid4().hex} river",
                                             max_tokens=2, extra_body={"prompt_cache_key": key})
        served.setdefault(key, set()).add(answer.model_extra["kvharbor"]["replica_id"])
    assert all(len(replicas) == 1 for replicas in served.values()), served
    seen = set().union(*served.values())
    assert len(seen) == 2, served          # 12 keys all at home on one of two replicas: p = 2^-11
    assert all(replicas == {home(session_key("globex", k), seen)} for k, replicas in served.items())


def test_chat_and_responses_take_the_key_and_the_in_memory_retention(standard, kvharbor_app):
    chat = standard.chat.completions.create(model=kvharbor_app.model, max_tokens=2,
                                            messages=[{"role": "user", "content": "Name a lake."}],
                                            prompt_cache_key="agent-1", prompt_cache_retention="in_memory")
    assert chat.choices[0].message.content is not None
    response = standard.responses.create(model=kvharbor_app.model, input="Name a lake.", max_output_tokens=2,
                                         prompt_cache_key="agent-1", store=False)
    assert response.prompt_cache_key == "agent-1"


@pytest.mark.parametrize("field, value", [("prompt_cache_retention", "24h"), ("prompt_cache_key", ""),
                                          ("prompt_cache_key", "k" * 1025)])
def test_what_kvharbor_cannot_do_is_a_400_naming_the_field(kvharbor_app, field, value):
    with kvharbor_app.client(DEMO["standard"]) as http:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/v1/responses", {"input": "Hi"})):
            r = http.post(path, json={"model": kvharbor_app.model, "max_tokens": 2, **body, field: value}
                          if path != "/v1/responses" else {"model": kvharbor_app.model, **body, field: value})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field


def test_affinity_decisions_are_counted_by_kind():
    """The routing dashboard's "Affinity decisions" reads these counts."""
    router = make_router(FakeShard())
    counted: list[str] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(inner, name)

        def router_affinity(self, kind: str) -> None:
            counted.append(kind)

    inner, router.metrics = router.metrics, Counting()
    replicas = {x: FakeReplica(x) for x in "abc"}
    route(router, list(replicas.values()), rid="k1", prompt_cache_key="agent-1")
    ranks, pr = route(router, list(replicas.values()), rid="s1", session_id="chat-1")
    routed(router, pr, replicas[uids(ranks)[0][0]])
    route(router, list(replicas.values()), rid="s2", session_id="chat-1")
    route(router, list(replicas.values()), rid="plain")
    _, pr = route(router, list(replicas.values()), rid="no-hashes", hashes=[])
    assert md(pr)["router_policy"] == "pow2_fallback"
    assert md(pr)["router_session_affinity"] is False and md(pr)["router_cache_key_affinity"] is False
    assert counted == ["cache_key", "session"]
