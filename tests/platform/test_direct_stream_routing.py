"""The router's side of direct streams (kvharbor.platform.direct_stream):
``KVAwareRouter.route_direct`` ranks and books like Serve's decisions, runs on the caller's
thread once the router follows the index, and excludes the router's own changes (its state
lock)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.platform.test_direct_stream import _req
from tests.platform.test_router_unit import FakeReplica, FakeShard, HASHES, make_router, route


def _direct_router(replicas):
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=HASHES[:40])
    shard.shard.apply_events("c", 0, stored=HASHES[:10])
    router = make_router(shard)
    router._replicas = {r.replica_id: r for r in replicas}
    return router


def test_route_direct_ranks_like_choose_replicas_among_listening_replicas_and_books_the_send():
    address = ["127.0.0.1", 1, "00"]
    replicas = [FakeReplica("a", direct=address), FakeReplica("b"),       # b does not listen
                FakeReplica("c", direct=address), FakeReplica("d", direct=address)]
    router = _direct_router(replicas)

    async def main():
        router._home_loop = asyncio.get_running_loop()
        first = await router.route_direct(_req("r1", HASHES))
        second = await router.route_direct(_req("r2", HASHES))
        pinned = await router.route_direct(_req("r3", HASHES), replica_id="d")
        unlisted = await router.route_direct(_req("r4", HASHES), replica_id="b")
        return first, second, pinned, unlisted

    first, second, pinned, unlisted = asyncio.run(main())
    assert first == ("c", address)        # b holds more of the prefix but takes no direct streams
    assert second[0] == "c" and pinned[0] == "d" and unlisted is None
    assert router._direct == {"c": 2, "d": 1}
    assert len(router._sent["c"]) == 2 and len(router._sent["d"]) == 1
    router._replica_queue_len_cache.update(replicas[2].replica_id, 1)   # Serve's count: 1
    assert router._in_flight(replicas[2]) == 3                          # + 2 direct streams

    async def end_two():
        router._home_loop = asyncio.get_running_loop()
        router.direct_done("c")
        router.direct_done("d")
        await asyncio.sleep(0)

    asyncio.run(end_two())
    assert router._direct == {"c": 1}


def _loop_thread():
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def _stop(loop, thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_route_direct_from_another_thread_decides_there_once_the_router_follows():
    """The gateway's loop asks. Before the router's first poll the decision runs on the loop
    Serve routes on (it waits for the index there); after it, on the caller's own thread, with
    the follower hurried on the router's loop; booked the same either way."""
    import threading

    address = ["127.0.0.1", 1, "00"]
    replicas = [FakeReplica("a", direct=address), FakeReplica("c", direct=address)]
    router = _direct_router(replicas)
    ran_on: list[int] = []
    rank, hurried = router._rank, []

    def spy(*args):
        ran_on.append(threading.get_ident())
        return rank(*args)

    router._rank = spy
    router.follower.hurry = lambda: hurried.append(threading.get_ident())
    loop, thread = _loop_thread()
    try:
        router._home_loop = loop
        first, second = _req("r1", HASHES), _req("r2", HASHES)
        hopped = asyncio.run(router.route_direct(first))
        router._first_poll = asyncio.Event()
        router._first_poll.set()
        here = asyncio.run(router.route_direct(second))
        time.sleep(0.1)
    finally:
        _stop(loop, thread)
    assert hopped == here == ("c", address)
    assert ran_on == [thread.ident, threading.get_ident()]
    assert hurried == [thread.ident, thread.ident]    # on the router's loop both times
    for request in (first, second):
        assert request.metadata["routed_to"] == "c"
        assert request.metadata["router_policy"] == "kv_aware"
    assert router._direct == {"c": 2} and len(router._sent["c"]) == 2


@pytest.mark.parametrize("poll", ["entries", "snapshot"])
def test_a_direct_decision_waits_while_the_router_changes_its_index(poll):
    """Mutual exclusion: while the follower applies a poll (entries, or a snapshot's replica)
    on the router's loop, a direct stream's decision on another thread waits for it (it would
    read the index half-changed); and the router's own changes wait while a direct decision
    holds its state."""
    import threading

    address = ["127.0.0.1", 1, "00"]
    replicas = [FakeReplica("a", direct=address), FakeReplica("c", direct=address)]
    router = _direct_router(replicas)
    router._first_poll = asyncio.Event()
    router._first_poll.set()
    entered, release = threading.Event(), threading.Event()
    follower = router.follower
    owner, name = (follower, "_replay") if poll == "entries" else (follower.index, "resync")
    change = getattr(owner, name)

    def slow_change(*args):
        entered.set()
        release.wait(5)
        return change(*args)

    setattr(owner, name, slow_change)
    loop, thread = _loop_thread()
    decided: list = []
    try:
        router._home_loop = loop
        st = follower.state[0]
        reply = ({"entries": [("remove", "zz")], "epoch": st.epoch, "cursor": st.cursor}
                 if poll == "entries" else
                 {"snapshot": {"zz": (0, {"device": []})}, "epoch": st.epoch, "cursor": st.cursor})
        applying = asyncio.run_coroutine_threadsafe(follower.apply(0, reply), loop)
        assert entered.wait(5)
        asker = threading.Thread(
            target=lambda: decided.append(asyncio.run(router.route_direct(_req("r1", HASHES)))))
        asker.start()
        time.sleep(0.3)
        waited = not decided
        release.set()
        applying.result(5)
        asker.join(5)
    finally:
        release.set()
        _stop(loop, thread)
    assert waited, "the direct decision read the index while the follower changed it"
    assert len(decided) == 1 and decided[0][1] == address

    pinned = _req("r3", HASHES)
    changes = [
        ("Serve's decision", lambda: route(router, replicas), lambda: True),
        ("Serve's booking", lambda: router._routed("a", _req("r2", HASHES), "k"), lambda: True),
        ("a direct decision for a named replica", lambda: router._decide_direct(pinned, "a"),
         lambda: "routed_to" not in pinned.metadata),
        ("a replica leaving", lambda: router._forget("a"), lambda: "a" in router._sent),
        ("a direct stream's end", lambda: router._direct_ended("c"), lambda: True)]
    for name, change, untouched in changes:
        assert _waits_for_the_state_lock(router, change, untouched), \
            f"{name} changed the router's state during a decision"
    assert "a" not in router._sent and router._direct == {}


def _waits_for_the_state_lock(router, change, untouched) -> bool:
    """Whether ``change`` (run on another thread) waits, with ``untouched()`` still true,
    while a decision holds the router's state lock."""
    import threading

    worker = threading.Thread(target=change)
    router._state_lock.acquire()                       # a direct decision under way
    try:
        worker.start()
        worker.join(0.3)
        blocked = worker.is_alive() and untouched()
    finally:
        router._state_lock.release()
    worker.join(5)
    return blocked


def test_a_direct_decision_never_blocks_the_callers_loop_on_the_lock():
    """While the router's loop holds the state lock (here: held for 0.4 s), a direct decision
    asked from another loop hops to the router's loop instead of blocking its caller's loop,
    which keeps running meanwhile; the decision completes once the lock is free."""
    import threading

    address = ["127.0.0.1", 1, "00"]
    router = _direct_router([FakeReplica("a", direct=address), FakeReplica("c", direct=address)])
    router._first_poll = asyncio.Event()
    router._first_poll.set()
    loop, thread = _loop_thread()
    router._home_loop = loop
    held = threading.Event()

    def hold_on_the_routers_loop():
        with router._state_lock:
            held.set()
            time.sleep(0.4)

    async def ask():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        choice = await router.route_direct(_req("r1", HASHES))
        ticker.cancel()
        return choice, ticks

    try:
        loop.call_soon_threadsafe(hold_on_the_routers_loop)
        assert held.wait(5)
        choice, ticks = asyncio.run(ask())
    finally:
        _stop(loop, thread)
    assert choice == ("c", address)
    assert ticks >= 10, f"the caller's loop ran {ticks} times in the 0.4 s the lock was held"
