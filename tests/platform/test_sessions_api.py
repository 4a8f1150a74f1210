"""What the gateway answers from every replica's reply to a session or flush call (no Ray:
the per-replica results are given)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvharbor.platform import sessions_api
from kvharbor.platform.error_body import APIError

HANDLE = SimpleNamespace(app_name="kvharbor", deployment_name="LLMReplica")


@pytest.fixture
def replies(monkeypatch):
    """Set ``replies.results``: each replica's answer (a value, None or an exception)."""
    state = SimpleNamespace(results=[], calls=[])

    def call_every_replica(app, deployment, method, *args):
        state.calls.append((app, deployment, method, args))
        return list(state.results)

    monkeypatch.setattr(sessions_api, "_call_every_replica", call_every_replica)
    return state


def _run(coro):
    return asyncio.run(coro)


def test_ending_a_session_sums_the_blocks_of_the_replicas_that_held_it(replies):
    replies.results = [None, 3, 2]
    assert _run(sessions_api.end_session_everywhere(HANDLE, "acme", "s1")) == 5
    assert replies.calls == [("kvharbor", "LLMReplica", "end_session", ("acme", "s1"))]
    replies.results = [None, None]
    assert _run(sessions_api.end_session_everywhere(HANDLE, "acme", "s1")) is None    # the route's 404


def test_a_failed_replica_is_a_503_only_when_no_other_answered(replies):
    """A replica that failed may hold the session: with no answer from any other the client
    is told to retry (503, Retry-After), not that the session is unknown; an answer from
    another replica is used."""
    replies.results = [None, RuntimeError("replica died")]
    with pytest.raises(APIError) as refused:
        _run(sessions_api.end_session_everywhere(HANDLE, "acme", "s1"))
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
    replies.results = [4, TimeoutError("no answer")]
    assert _run(sessions_api.end_session_everywhere(HANDLE, "acme", "s1")) == 4


def test_a_flush_sums_each_kind_over_the_replicas_that_answered(replies):
    replies.results = [{"blocks": 2, "sessions": 1}, {"blocks": 3}, RuntimeError("down")]
    assert _run(sessions_api.flush_everywhere(HANDLE, ["salt"], ["acme"])) == \
        {"replicas": 2, "blocks": 5, "sessions": 1}
    assert replies.calls[-1][2:] == ("flush_cache", (["salt"], ["acme"]))


def test_a_fork_is_its_blocks_404_when_no_replica_holds_it_409_when_the_target_exists(replies):
    replies.results = [None, {"blocks": 4}]
    assert _run(sessions_api.fork_session_everywhere(HANDLE, "acme", "s1", "s2")) == 4
    for results, status, code in [([None, None], 404, "session_not_found"),
                                  ([{"error": "session 's2' exists"}], 409, "session_exists")]:
        replies.results = results
        with pytest.raises(APIError) as refused:
            _run(sessions_api.fork_session_everywhere(HANDLE, "acme", "s1", "s2"))
        assert (refused.value.status, refused.value.code) == (status, code)
