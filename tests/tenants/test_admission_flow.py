"""The gateway's side of admission (``kvharbor.platform.admission_flow.Admitter``) for the
classes that take the actor calls: which refusals a gateway remembers and for how long, what
is given back when the class queue refuses or the admission actor does not answer, and the
leases of queue places and tickets. Harness (no Ray): ``fast_lane_harness.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvharbor.platform import admission_flow
from kvharbor.platform.class_queue import ClassQueue
from kvharbor.platform.error_body import APIError, retry_headers
from kvharbor.platform.overload_guard import OverloadGuard
from kvharbor.tenants.leases import LeaseTable
from tests.tenants.fast_lane_harness import Cluster, finish, request, run


def test_a_concurrency_refusal_is_not_remembered():
    """Only refusals that nothing but time clears (requests_per_minute, the daily budget) are
    answered from the gateway's memory: a tenant refused at max_concurrent_requests is admitted
    as soon as one of its requests ends."""
    cluster = Cluster()
    gw = cluster.gateway()
    globex = cluster.principal("globex", qos="standard", max_concurrent_requests=1)

    async def scenario():
        first = await request(gw, globex, "s0")
        refused = await request(gw, globex, "s1")
        assert isinstance(refused, APIError) and refused.status == 429, refused
        assert refused.code == "max_concurrent_requests"
        await finish(gw, globex, "s0", first, 5)
        again = await request(gw, globex, "s2")
        assert not isinstance(again, APIError), again

    run(scenario())


def test_a_refusal_says_how_long_to_wait_to_the_millisecond():
    """tokens_per_minute 6000 refills 100 tokens a second: a request 4 tokens short is told
    to retry in 40 ms (``retry-after-ms``, which OpenAI's clients read first), with
    ``Retry-After`` rounded up to the 1 s HTTP's whole seconds allow; after those 40 ms it
    is admitted."""
    cluster = Cluster()
    gw = cluster.gateway()
    globex = cluster.principal("globex", qos="standard", tokens_per_minute=6000)

    async def scenario():
        first = await request(gw, globex, "s0", prompt=5980, max_tokens=16)    # 4 tokens left
        await finish(gw, globex, "s0", first, 5996)
        refused = await request(gw, globex, "s1", prompt=4, max_tokens=4)
        assert isinstance(refused, APIError) and refused.code == "tokens_per_minute", refused
        assert refused.headers == {"Retry-After": "1", "retry-after-ms": "40"}, refused.headers
        assert refused.message.endswith("retry in 40 ms"), refused.message
        cluster.clock.t += 0.030
        early = await request(gw, globex, "s2", prompt=4, max_tokens=4)
        assert isinstance(early, APIError), early
        assert abs(int(early.headers["retry-after-ms"]) - 10) <= 1, early.headers
        cluster.clock.t += 0.011
        admitted = await request(gw, globex, "s3", prompt=4, max_tokens=4)
        assert not isinstance(admitted, APIError), admitted

    run(scenario())


@pytest.mark.parametrize("wait_s", [0.0, 0.0004, 0.04, 1.0, 1.4, 59.99])
def test_the_retry_headers_never_ask_for_a_retry_before_the_wait_is_over(wait_s):
    headers = retry_headers(wait_s)
    seconds, ms = int(headers["Retry-After"]), int(headers["retry-after-ms"])
    assert seconds >= max(1.0, wait_s) and seconds - wait_s < 1 or wait_s < 1 and seconds == 1, headers
    assert wait_s * 1000 <= ms < wait_s * 1000 + 1 or wait_s < 0.001 and ms == 1, headers


def test_a_class_queue_refusal_leaves_the_overload_guards_count():
    """A request the class queue refuses (queue_full) is not in flight: the overload guard
    must not count it, or a run of refusals would shed the class for good."""
    cluster = Cluster(max_queue=1)
    gw = cluster.gateway(guard=OverloadGuard(lag_target_ms=1000.0))
    globex = cluster.principal("globex", qos="standard")

    async def scenario():
        running = await request(gw, globex, "s0")
        refusals = [await request(gw, globex, f"s{i}") for i in range(1, 6)]
        assert all(isinstance(r, APIError) and r.code == "queue_full" for r in refusals), refusals
        assert gw.guard.in_flight == 1
        await finish(gw, globex, "s0", running, 5)
        assert gw.guard.in_flight == 0

    run(scenario())


def test_a_running_requests_queue_place_is_renewed_past_its_lease():
    """Queue places are leased so that a dead gateway's come back; a live request's place is
    renewed and stays counted however long the request runs."""
    cluster = Cluster()
    cluster.queue = ClassQueue(leases=LeaseTable(0.3), holders=LeaseTable(0.3))
    gw = cluster.gateway(lease_s=0.3)
    globex = cluster.principal("globex", qos="standard")

    async def scenario():
        running = await request(gw, globex, "s0")
        await asyncio.sleep(1.0)                     # three leases long
        cluster.queue.expire()
        assert cluster.queue.snapshot() == {"standard": 1}
        await finish(gw, globex, "s0", running, 5)
        assert cluster.queue.snapshot() == {"standard": 0}

    run(scenario())


def test_a_requests_per_minute_refusal_is_answered_from_memory_until_its_retry_after(monkeypatch):
    """A tenant over requests_per_minute is refused by the gateway itself, with no actor call
    and a Retry-After that counts down, until that time has passed or tenants.yaml changed."""
    cluster = Cluster()
    monkeypatch.setattr(admission_flow, "time", SimpleNamespace(time=cluster.clock))
    gw = cluster.gateway()
    globex = cluster.principal("globex", qos="standard", requests_per_minute=1)

    async def scenario():
        first = await request(gw, globex, "s0")
        await finish(gw, globex, "s0", first, 5)
        refused = await request(gw, globex, "s1")                  # the actor's refusal
        assert isinstance(refused, APIError) and refused.code == "requests_per_minute", refused
        wait, wait_ms = int(refused.headers["Retry-After"]), int(refused.headers["retry-after-ms"])
        assert 30 < wait <= 60 and (wait - 1) * 1000 < wait_ms <= wait * 1000, refused.headers
        assert cluster.queue.snapshot() == {"standard": 0}          # its queue place is back
        calls = dict(cluster.calls)
        cluster.clock.t += 20
        remembered = await request(gw, globex, "s2")
        assert isinstance(remembered, APIError) and remembered.code == "requests_per_minute"
        assert cluster.calls == calls, "a remembered refusal made an actor call"
        assert int(remembered.headers["Retry-After"]) == wait - 20
        assert abs(int(remembered.headers["retry-after-ms"]) - (wait_ms - 20_000)) <= 1, remembered.headers
        cluster.registry.version += 1                             # a reload: ask the actor again
        asked = await request(gw, globex, "s3")
        assert isinstance(asked, APIError) and asked.code == "requests_per_minute", asked
        assert cluster.calls["try_admit"] == calls["try_admit"] + 1
        cluster.clock.t += int(asked.headers["Retry-After"])
        admitted = await request(gw, globex, "s4")
        assert not isinstance(admitted, APIError), admitted

    run(scenario())


def test_an_admission_service_that_does_not_answer_gives_503_and_the_queue_place_back():
    """The admission actor times out: the client is told to retry (503 with Retry-After), and
    the class-queue place and the overload guard's count taken for the request are given back."""
    cluster = Cluster()
    gw = cluster.gateway(guard=OverloadGuard(lag_target_ms=1000.0))
    globex = cluster.principal("globex", qos="standard")

    async def silent(*args, **kwargs):
        raise TimeoutError

    object.__setattr__(gw.admission, "try_admit", silent)

    async def scenario():
        error = await request(gw, globex, "s0")
        assert isinstance(error, APIError) and error.status == 503, error
        assert error.code == "admission_unavailable" and error.headers["Retry-After"] == "1"
        assert cluster.queue.snapshot() == {"standard": 0}
        assert gw.guard.in_flight == 0

    run(scenario())


def test_an_actor_admitted_requests_ticket_is_renewed_past_its_lease():
    """The admission actor's tickets are leased like queue places: a live request's ticket is
    renewed and keeps the tenant's concurrency slot however long the request runs."""
    cluster = Cluster()
    gw = cluster.gateway(lease_s=0.3)               # renewals every 0.1 s
    globex = cluster.principal("globex", qos="standard", max_concurrent_requests=1)

    async def scenario():
        running = await request(gw, globex, "s0")
        for _ in range(3):                           # three leases of the actor's clock
            cluster.lease_clock.t += 6
            await asyncio.sleep(0.25)
        refused = await request(gw, globex, "s1")
        assert isinstance(refused, APIError) and refused.code == "max_concurrent_requests", refused
        await finish(gw, globex, "s0", running, 5)
        assert not isinstance(await request(gw, globex, "s2"), APIError)

    run(scenario())


def test_a_queue_refusal_with_nothing_to_recall_is_answered_after_one_call():
    """queue_full with no idle fast-lane places to call back: one class-queue call, no wait
    for other gateways' syncs and no second try."""
    cluster = Cluster(max_queue=1)
    gw = cluster.gateway()
    globex = cluster.principal("globex", qos="standard")

    async def scenario():
        running = await request(gw, globex, "s0")
        refused = await request(gw, globex, "s1")
        assert isinstance(refused, APIError) and refused.code == "queue_full", refused
        assert cluster.calls["enter_or_recall"] == 2                 # s0's and s1's
        await finish(gw, globex, "s0", running, 5)

    run(scenario())


def test_an_admission_refused_while_grants_were_idle_is_tried_again_after_their_sync(monkeypatch):
    """The admission actor refuses (429) and calls back fast-lane units other gateways hold
    idle (``recalled``): the gateway gives back its own, waits for their next sync and tries
    once more, and that try admits the request."""
    monkeypatch.setattr(admission_flow, "RECALL_WAIT_S", 0.01)
    cluster = Cluster()
    gw = cluster.gateway()
    globex = cluster.principal("globex", qos="standard")
    real, answers, syncs = gw.admission.try_admit, [], []

    async def refused_once(*args, **kwargs):
        if not answers:
            answers.append("refused")
            return SimpleNamespace(ok=False, status=429, reason="idle grants elsewhere",
                                   retry_after_s=1.0, limit="max_concurrent_requests", recalled=True)
        answers.append("admitted")
        return await real(*args, **kwargs)

    async def sync():
        syncs.append(1)

    object.__setattr__(gw.admission, "try_admit", refused_once)
    gw.lane.sync = sync

    async def scenario():
        ticket = await request(gw, globex, "s0")
        assert not isinstance(ticket, APIError), ticket
        assert answers == ["refused", "admitted"] and syncs == [1]
        await finish(gw, globex, "s0", ticket, 5)

    run(scenario())


def test_a_place_the_class_queue_grants_after_the_gateway_gave_up_is_given_back(monkeypatch):
    """The class queue answers after the call's timeout (503 to the client): when its answer
    admits the request after all, the gateway gives that place back, so the class is not
    left one place short for good."""
    monkeypatch.setattr(admission_flow, "CALL_TIMEOUT_S", 0.05)
    cluster = Cluster()
    gw = cluster.gateway()
    globex = cluster.principal("globex", qos="standard")
    queue = gw.class_queue

    def late_enter(*args):
        answer = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.15, answer.set_result, cluster.queue.enter_or_recall(*args))
        return answer

    gw.class_queue = SimpleNamespace(enter_or_recall=SimpleNamespace(remote=late_enter),
                                     leave=queue.leave, renew=queue.renew)

    async def scenario():
        error = await request(gw, globex, "s0")
        assert isinstance(error, APIError) and error.status == 503, error
        await asyncio.sleep(0.3)
        assert cluster.queue.snapshot() == {"standard": 0}

    run(scenario())


def test_a_queue_refusal_that_recalls_twice_waits_for_one_sync_only(monkeypatch):
    """Each class-queue answer calls idle places back: the gateway waits for the others' sync
    once, tries once more, and answers queue_full (no second wait after the last try)."""
    monkeypatch.setattr(admission_flow, "RECALL_WAIT_S", 0.01)
    cluster = Cluster()
    gw = cluster.gateway()
    globex = cluster.principal("globex", qos="standard")
    syncs = []

    def full_but_recalled(*args):
        answer = asyncio.get_running_loop().create_future()
        answer.set_result((64, True))
        return answer

    async def sync():
        syncs.append(1)

    gw.class_queue = SimpleNamespace(enter_or_recall=SimpleNamespace(remote=full_but_recalled))
    gw.lane.sync = sync

    async def scenario():
        refused = await request(gw, globex, "s0")
        assert isinstance(refused, APIError) and refused.code == "queue_full", refused
        assert syncs == [1]

    run(scenario())
