"""A router's follower index equals the directory's index, through log overflow, replay
mismatches and a directory restart; the event log keeps its bounds."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvharbor.actors.directory_log import EventLog
from kvharbor.actors.prefix_directory import DirectoryShard, PrefixIndex
from kvharbor.engine.hashing import hash_prompt_blocks
from kvharbor.platform.index_follower import IndexFollower
from tests.platform.follower_helpers import CountingActorShard, returns_within


def chain(n: int, salt: str) -> list:
    return hash_prompt_blocks(list(range(n * 4)), 4, salt=salt)


class LocalShard:
    """A ``DirectoryShard`` answering polls in-process (optionally failing)."""

    def __init__(self, shard: DirectoryShard) -> None:
        self.shard, self.fail, self.calls = shard, False, 0

    async def poll(self, epoch, cursor, max_entries):
        self.calls += 1
        if self.fail:
            raise ConnectionError("directory down")
        return self.shard.poll(epoch, cursor, max_entries)


def views(index: PrefixIndex) -> dict:
    """Per replica: (next seq, {tier: set of hashes}, known prefix-closed), comparable across
    indexes."""
    return {r: (seq, {t: set(h) for t, h in tiers.items()}, index.is_closed(r))
            for r, (seq, tiers) in index.snapshot().items()}


def random_traffic(shard: DirectoryShard, rng: random.Random, seqs: dict, n: int) -> None:
    pool = chain(30, "x") + chain(30, "y")
    for _ in range(n):
        r = rng.choice(["a", "b", "c"])
        roll = rng.random()
        if roll < 0.04:
            shard.remove_replica(r)
            seqs.pop(r, None)
        elif roll < 0.08:
            seqs[r] = seqs.get(r, 0) + 5
            shard.resync(r, seqs[r] - 1, {"device": rng.sample(pool, 10), "host": []},
                         rng.random() < 0.5)
        else:
            tier = rng.choice(["device", "device", "host"])
            assert shard.apply_events(r, seqs.get(r, 0), rng.sample(pool, 4), rng.sample(pool, 2),
                                      tier, rng.choice([None, True, False]))
            seqs[r] = seqs.get(r, 0) + 1


def test_follower_replays_the_log_into_an_equal_index():
    shard, rng, seqs = DirectoryShard(), random.Random(1), {}
    follower = IndexFollower([LocalShard(shard)], max_entries=7)
    for _ in range(40):
        random_traffic(shard, rng, seqs, 10)
        asyncio.run(follower.poll_once())
        asyncio.run(follower.poll_once())
        assert views(follower.index) == views(shard._index)
    assert follower.counters.snapshots == 1          # only the first poll (a new follower)
    assert follower.counters.entries > 300 and follower.counters.mismatches == 0
    assert follower.status() is None
    follower.index.check_integrity()


def test_a_follower_behind_the_bounded_log_takes_a_snapshot():
    shard, rng, seqs = DirectoryShard(max_log_entries=16), random.Random(2), {}
    follower = IndexFollower([LocalShard(shard)])
    asyncio.run(follower.poll_once())
    random_traffic(shard, rng, seqs, 100)            # far more than the log keeps
    asyncio.run(follower.poll_once())
    assert follower.counters.snapshots == 2
    assert views(follower.index) == views(shard._index)


def test_replay_mismatch_forces_a_snapshot_and_recovers():
    """Each snapshot and each mismatch is reported (the router counts them as
    ``directory_resync`` on the routing dashboard)."""
    shard, reported = DirectoryShard(), []
    follower = IndexFollower([LocalShard(shard)], on_resync=reported.append)
    shard.apply_events("a", 0, chain(3, "p"))
    asyncio.run(follower.poll_once())
    follower.index.remove_replica("a")               # the follower lost state somehow
    shard.apply_events("a", 1, chain(4, "p")[3:])
    asyncio.run(follower.poll_once())                # replay of batch 1 finds a gap
    assert follower.counters.mismatches == 1
    asyncio.run(follower.poll_once())
    assert views(follower.index) == views(shard._index)
    assert follower.index.match(chain(4, "p"))["a"].blocks == 4
    assert reported == ["router_snapshot", "replay_mismatch", "router_snapshot"]


def test_directory_restart_keeps_unsynced_views_until_replicas_resync():
    local = LocalShard(DirectoryShard())
    follower = IndexFollower([local])
    local.shard.apply_events("a", 0, chain(5, "a"))
    local.shard.apply_events("b", 0, chain(5, "b"))
    asyncio.run(follower.poll_once())
    local.shard = DirectoryShard()                   # restarted: empty, new epoch
    local.shard.resync("a", 3, {"device": chain(2, "a")})   # a resynced already, b not yet
    asyncio.run(follower.poll_once())
    assert follower.index.match(chain(5, "a"))["a"].blocks == 2
    assert follower.index.match(chain(5, "b"))["b"].blocks == 5     # kept, not blanked
    local.shard.resync("b", 0, {"device": chain(1, "b")})
    local.shard.apply_events("b", 1, chain(3, "b")[1:])
    asyncio.run(follower.poll_once())
    assert views(follower.index) == views(local.shard._index)


def test_status_reports_not_started_then_live_then_stale():
    now = [100.0]
    local = LocalShard(DirectoryShard())
    follower = IndexFollower([local], stale_after_s=2.0, clock=lambda: now[0])
    local.fail = True
    asyncio.run(follower.poll_once())
    assert follower.status() == "stream_not_started"
    local.fail = False
    asyncio.run(follower.poll_once())
    assert follower.status() is None
    local.fail, now[0] = True, 103.0
    asyncio.run(follower.poll_once())
    assert follower.status() == "stream_stale" and follower.lag_s() == pytest.approx(3.0)


def test_shards_are_followed_independently_into_one_index():
    from kvharbor.actors.prefix_directory import shard_of

    shards = [DirectoryShard(), DirectoryShard()]
    follower = IndexFollower([LocalShard(s) for s in shards])
    replicas = [f"replica-{i}" for i in range(8)]
    for r in replicas:
        shards[shard_of(r, 2)].apply_events(r, 0, chain(3, r))
    assert {shard_of(r, 2) for r in replicas} == {0, 1}
    asyncio.run(follower.poll_once())
    assert sorted(follower.index.replicas()) == replicas
    shards[shard_of("replica-0", 2)].clear()          # one shard cleared: only its replicas go
    asyncio.run(follower.poll_once())
    assert sorted(follower.index.replicas()) == [r for r in replicas if shard_of(r, 2) != shard_of("replica-0", 2)]


def test_event_log_keeps_its_bounds_and_refuses_readers_behind_it():
    log = EventLog(max_entries=4, max_hashes=10)
    for i in range(6):
        log.append(("events", "a", i, [b"h"] * 3, [], "device"))
    assert log.end == 6 and log.first == 3            # 3 entries x 3 hashes <= 10
    assert log.read(log.epoch, 2) is None and log.read("other-epoch", 4) is None
    got = log.read(log.epoch, 4)
    assert (got.start, got.next_cursor, [e[2] for e in got.entries]) == (4, 6, [4, 5])
    assert log.read(log.epoch, 6).entries == []
    assert log.read(log.epoch, 7) is None             # ahead of the log: a cursor it never gave
    assert EventLog().epoch != log.epoch
    for bad in (dict(max_entries=0), dict(max_hashes=0)):
        with pytest.raises(ValueError):
            EventLog(**bad)


def test_an_idle_follower_polls_slower_and_hurry_brings_the_next_events_at_once():
    """Polls are actor calls: with nothing arriving, the follower slows from
    ``poll_interval_s`` to ``idle_poll_interval_s``; ``hurry()`` (a routed request) cuts the
    idle pause short, so the request's events arrive at full pace."""
    shard = DirectoryShard()
    local = LocalShard(shard)
    follower = IndexFollower([local], poll_interval_s=0.01, idle_poll_interval_s=1.0,
                             idle_after_s=0.1, stale_after_s=5.0)

    async def go():
        task = asyncio.create_task(follower.run())
        await asyncio.sleep(1.15)                  # 0.1 s at full pace, then one idle pause
        idle_polls = local.calls
        assert follower.idle()
        calls = local.calls
        while local.calls == calls:                 # an idle pause has just begun
            await asyncio.sleep(0.005)
        shard.apply_events("a", 0, chain(2, "a"))
        follower.hurry()
        start = asyncio.get_running_loop().time()
        while not follower.index.replicas():
            await asyncio.sleep(0.005)
        waited = asyncio.get_running_loop().time() - start
        task.cancel()
        return idle_polls, waited

    idle_polls, waited = asyncio.run(go())
    assert idle_polls <= 16, f"{idle_polls} polls in 1.15 s (at full pace: ~100)"
    assert waited < 0.2, f"the event took {waited:.3f} s after hurry() (idle pause: 1 s)"
    assert not follower.idle()


def test_an_idle_follower_still_sees_other_routers_events_within_its_idle_interval():
    shard = DirectoryShard()
    follower = IndexFollower([LocalShard(shard)], poll_interval_s=0.01,
                             idle_poll_interval_s=0.2, idle_after_s=0.05)

    async def go():
        task = asyncio.create_task(follower.run())
        await asyncio.sleep(0.4)
        assert follower.idle()
        shard.apply_events("b", 0, chain(2, "b"))            # nobody hurries this one
        start = asyncio.get_running_loop().time()
        while not follower.index.replicas():
            await asyncio.sleep(0.005)
        task.cancel()
        return asyncio.get_running_loop().time() - start

    assert asyncio.run(go()) < 0.35


def test_a_follower_over_directory_actors_stops_once_ray_is_shut_down(monkeypatch):
    """``run`` left in a driver (a test, a script) after ray.shutdown() returns instead of
    polling an actor: that call would make Ray start a new local cluster at interpreter exit.
    (Ray's state is stood in for in kvharbor's module, never by patching ``ray.is_initialized``:
    see ``index_follower.ray_initialized``.)"""
    from kvharbor.platform import index_follower

    shard = CountingActorShard()
    follower = IndexFollower([shard], poll_interval_s=0.01)

    monkeypatch.setattr(index_follower, "ray_initialized", lambda: True)
    assert asyncio.run(returns_within(follower.run, 0.05)) is False and shard.polls >= 1
    polls = shard.polls
    monkeypatch.setattr(index_follower, "ray_initialized", lambda: False)
    assert asyncio.run(returns_within(follower.run, 0.05)) is True and shard.polls == polls


def test_a_follower_behind_the_log_forgets_replicas_removed_meanwhile():
    """The snapshot a lagging follower takes is the whole truth of its shard: a replica the
    directory forgot while the follower was behind its log is forgotten here too."""
    shard = DirectoryShard(max_log_entries=4)
    follower = IndexFollower([LocalShard(shard)])
    shard.apply_events("a", 0, chain(3, "a"))
    shard.apply_events("b", 0, chain(3, "b"))
    asyncio.run(follower.poll_once())
    assert sorted(follower.index.replicas()) == ["a", "b"]
    shard.remove_replica("b")
    for seq in range(1, 8):                          # the "remove" entry leaves the log
        shard.apply_events("a", seq, chain(3 + seq, "a")[2 + seq:])
    asyncio.run(follower.poll_once())
    assert follower.counters.snapshots == 2
    assert follower.index.replicas() == ["a"]
    assert views(follower.index) == views(shard._index)


def test_every_shard_must_answer_for_the_index_to_be_trusted():
    now = [100.0]
    first, second = LocalShard(DirectoryShard()), LocalShard(DirectoryShard())
    follower = IndexFollower([first, second], stale_after_s=2.0, clock=lambda: now[0])
    second.fail = True
    asyncio.run(follower.poll_once())
    assert follower.status() == "stream_not_started"     # the first shard alone answered
    second.fail = False
    asyncio.run(follower.poll_once())
    assert follower.status() is None
    first.fail, now[0] = True, 103.0
    asyncio.run(follower.poll_once())                   # the second shard still answers
    assert follower.status() == "stream_stale"
    assert follower.lag_s() == pytest.approx(3.0)       # the shard heard from longest ago


def test_entries_keep_the_follower_at_full_pace_without_a_hurry():
    """Events caused by other routers' traffic keep this follower polling fast while they
    flow; it slows down only once polls bring nothing for ``idle_after_s``."""
    now = [10.0]
    shard = DirectoryShard()
    follower = IndexFollower([LocalShard(shard)], idle_after_s=1.0, clock=lambda: now[0])
    asyncio.run(follower.poll_once())                   # the first snapshot: active
    now[0] = 12.0
    assert follower.idle()
    shard.apply_events("b", 0, chain(2, "b"))
    asyncio.run(follower.poll_once())
    now[0] = 12.5
    assert not follower.idle()
    asyncio.run(follower.poll_once())                   # nothing new
    now[0] = 13.6
    assert follower.idle()


def test_an_idle_pause_is_between_the_fast_pause_and_the_staleness_limit():
    """A follower idling longer than ``stale_after_s`` would call its own index stale."""
    slow = IndexFollower([], poll_interval_s=0.02, idle_poll_interval_s=10.0, stale_after_s=2.0)
    assert slow.idle_poll_interval_s == 2.0
    fast = IndexFollower([], poll_interval_s=0.5, idle_poll_interval_s=0.1)
    assert fast.idle_poll_interval_s == 0.5


def test_snapshots_and_replayed_resyncs_confirm_stored_blocks():
    """``on_stored`` (the router confirms its active blocks with it) hears of every block the
    index learns a replica holds: batches, resyncs replayed from the log, and snapshots."""
    shard = DirectoryShard()
    stored: list = []
    follower = IndexFollower([LocalShard(shard)], on_stored=lambda r, hs: stored.append((r, set(hs))))
    shard.apply_events("a", 0, chain(2, "a"))
    asyncio.run(follower.poll_once())                   # a new follower: a snapshot
    assert stored == [("a", set(chain(2, "a")))]
    stored.clear()
    shard.resync("a", 4, {"device": chain(3, "a"), "host": chain(1, "h")})
    shard.apply_events("b", 0, chain(1, "b"))
    asyncio.run(follower.poll_once())
    assert stored == [("a", set(chain(3, "a")) | set(chain(1, "h"))), ("b", set(chain(1, "b")))]


def test_an_actor_shard_looks_the_directory_up_again_after_a_failed_poll():
    """A directory actor that died and was created anew under its name is a new handle: the
    failed call drops the old one, so the next poll finds the new actor."""
    from types import SimpleNamespace

    from kvharbor.platform.index_follower import ActorShard

    def handle(reply):
        """An actor handle whose ``poll.remote(...)`` answers ``reply`` (or raises it)."""
        async def poll(*_):
            if isinstance(reply, Exception):
                raise reply
            return reply

        return SimpleNamespace(poll=SimpleNamespace(remote=poll))

    shard = ActorShard("kvh-test", None, timeout_s=1.0, retry_s=0.0,
                       handle=handle(RuntimeError("actor died")))
    shard._get_actor = lambda: handle({"epoch": "e2", "cursor": 0, "entries": []})
    with pytest.raises(RuntimeError):
        asyncio.run(shard.poll(None, 0, 16))
    assert asyncio.run(shard.poll(None, 0, 16))["epoch"] == "e2"


def test_an_actor_shard_looks_the_directory_up_for_a_control_call_and_returns_its_answer():
    """A control-plane call (the router telling the directory a replica is gone) made
    before any poll finds the actor by name first, and hands back what the actor answered."""
    from types import SimpleNamespace

    from kvharbor.platform.index_follower import ActorShard

    async def remove_replica(uid):
        return ("removed", uid)

    shard = ActorShard("kvh-test", None, timeout_s=1.0, retry_s=0.0)
    shard._get_actor = lambda: SimpleNamespace(remove_replica=SimpleNamespace(remote=remove_replica))
    assert asyncio.run(shard.call("remove_replica", "r1")) == ("removed", "r1")
    assert asyncio.run(shard.call("remove_replica", "r2")) == ("removed", "r2")


def test_event_log_counts_every_hash_an_entry_carries_and_keeps_the_newest_entry():
    log = EventLog(max_entries=100, max_hashes=10)
    assert [log.append(("events", "a", i, [], [b"h"] * 4, "device")) for i in range(3)] == [0, 1, 2]
    assert log.first == 1                             # removed hashes count: 12 > 10
    log.append(("resync", "a", 3, {"device": [b"h"] * 3, "host": [b"h"] * 3}))
    assert log.first == 2 and log.stats()["log_hashes"] == 10
    log.append(("resync", "a", 4, {"device": [b"h"] * 50}))    # alone over the bound: kept
    assert (log.first, log.end) == (4, 5) and len(log.read(log.epoch, 4).entries) == 1


def test_event_log_reads_at_most_max_entries_at_a_time():
    log = EventLog()
    for i in range(5):
        log.append(("remove", f"r{i}"))
    got = log.read(log.epoch, 1, max_entries=2)
    assert [e[1] for e in got.entries] == ["r1", "r2"] and got.next_cursor == 3


def test_the_shard_logs_only_what_changed_its_index():
    """Followers replay the log batch by batch: a duplicate batch or the removal of a replica
    the shard does not know must not reach it (a follower would replay it as a mismatch)."""
    shard = DirectoryShard()
    assert shard.apply_events("a", 0, chain(2, "a"))
    assert shard.apply_events("a", 0, chain(2, "a"))          # a duplicate: accepted, not logged
    shard.remove_replica("nobody")
    assert shard.stats()["log_end"] == 1
    follower = IndexFollower([LocalShard(shard)])
    asyncio.run(follower.poll_once())
    assert shard.apply_events("a", 1, chain(3, "a")[2:])
    assert shard.apply_events("a", 1, chain(3, "a")[2:])
    asyncio.run(follower.poll_once())
    assert follower.counters.mismatches == 0 and follower.counters.snapshots == 1


def test_a_replica_with_a_gap_is_unknown_to_the_heartbeat_and_left_out_of_snapshots():
    """After a sequence gap the shard's view of the replica is incomplete: its heartbeat says
    so (the replica then resyncs) and snapshots leave it out until the resync."""
    shard = DirectoryShard()
    shard.apply_events("a", 0, chain(2, "a"))
    shard.apply_events("b", 0, chain(2, "b"))
    assert shard.heartbeat("a") == (shard.stats()["epoch"], True)
    assert not shard.apply_events("a", 2, chain(4, "a")[2:])     # batch 1 lost
    assert shard.heartbeat("a") == (shard.stats()["epoch"], False)
    assert set(shard.snapshot()["snapshot"]) == {"b"}
    shard.resync("a", 2, {"device": chain(4, "a")})
    assert shard.heartbeat("a")[1] and set(shard.snapshot()["snapshot"]) == {"a", "b"}


def test_shards_share_the_directorys_block_bound(monkeypatch):
    from kvharbor.actors import prefix_directory

    monkeypatch.setattr(prefix_directory, "get_or_create_directory",
                        lambda name, namespace, max_blocks, detached: (name, max_blocks))
    got = prefix_directory.get_or_create_directories("d", num_shards=4, max_blocks=1000)
    assert got == [("d/0", 250), ("d/1", 250), ("d/2", 250), ("d/3", 250)]


def test_closed_flags_reach_the_follower_by_replay_and_by_snapshot():
    """What each replica said about its cache being prefix-closed (batches, resyncs) is in
    the follower's index too, replayed from the log or taken from a snapshot: a follower
    that lost it would match those replicas block by block, one that invented it would
    bisect a view with holes."""
    shard = DirectoryShard(max_log_entries=4)
    follower = IndexFollower([LocalShard(shard)])
    asyncio.run(follower.poll_once())
    assert shard.apply_events("a", 0, chain(3, "a"), closed=True)
    shard.resync("b", 4, {"device": chain(2, "b"), "host": []}, True)
    assert shard.apply_events("b", 5, chain(1, "b2"))                 # None: still closed
    shard.resync("c", 0, {"device": chain(2, "c"), "host": []}, False)
    asyncio.run(follower.poll_once())                                  # replayed entries
    assert follower.counters.snapshots == 1
    assert follower.index.closed_replicas() == ["a", "b"]
    for seq in range(1, 6):                                            # the log overflows
        assert shard.apply_events("c", seq, chain(1, f"c{seq}"), closed=seq % 2 == 1)
    assert shard.apply_events("a", 1, removed=chain(1, "a"), closed=False)
    asyncio.run(follower.poll_once())
    assert follower.counters.snapshots == 2
    assert follower.index.closed_replicas() == ["b", "c"] == shard._index.closed_replicas()
    assert views(follower.index) == views(shard._index)


def test_a_shard_never_heard_from_makes_the_lag_unbounded():
    """The router exports ``lag_s`` as its index lag: a shard that never answered is not
    'just synced' (0 s) but infinitely behind."""
    answering, silent = LocalShard(DirectoryShard()), LocalShard(DirectoryShard())
    silent.fail = True
    follower = IndexFollower([answering, silent])
    asyncio.run(follower.poll_once())
    assert follower.lag_s() == float("inf")
    silent.fail = False
    asyncio.run(follower.poll_once())
    assert follower.lag_s() < 1.0


def test_a_directory_outage_is_logged_once_until_the_shard_answers_again(caplog):
    """Polls run every 20 ms: a shard that stays down logs one warning, not one per poll;
    a new outage after it answered again logs once more."""
    local = LocalShard(DirectoryShard())
    follower = IndexFollower([local])
    local.fail = True
    with caplog.at_level("WARNING", logger="kvharbor.platform.index_follower"):
        for _ in range(3):
            asyncio.run(follower.poll_once())
        assert len(caplog.records) == 1 and "poll failed" in caplog.records[0].getMessage()
        local.fail = False
        asyncio.run(follower.poll_once())
        local.fail = True
        asyncio.run(follower.poll_once())
    assert len(caplog.records) == 2
    assert follower.counters.poll_errors == 4


def test_an_actor_shard_waits_retry_s_before_looking_a_missing_directory_up_again():
    """Each lookup asks Ray's GCS (in a thread): a directory that does not exist yet is looked
    up again only after ``retry_s``, not at every poll."""
    from kvharbor.platform.index_follower import ActorShard

    lookups = []

    def missing():
        lookups.append(1)
        raise ValueError("Failed to look up actor 'kvh-test'")

    shard = ActorShard("kvh-test", None, timeout_s=1.0, retry_s=60.0)
    shard._get_actor = missing
    with pytest.raises(ValueError):
        asyncio.run(shard.poll(None, 0, 16))
    for _ in range(3):
        with pytest.raises(LookupError, match="not found yet"):
            asyncio.run(shard.poll(None, 0, 16))
    assert len(lookups) == 1


def test_a_busy_follower_pauses_poll_interval_s_not_the_idle_interval():
    follower = IndexFollower([], poll_interval_s=0.01, idle_poll_interval_s=1.0, stale_after_s=5.0)

    async def paused() -> float:
        follower.hurry()
        loop = asyncio.get_running_loop()
        start = loop.time()
        await follower.pause()
        return loop.time() - start

    assert asyncio.run(paused()) < 0.5


def test_a_snapshot_lets_routing_decisions_run_between_its_replicas():
    """A snapshot of a big fleet is applied a replica at a time, yielding the router's loop
    in between, so decisions made meanwhile are not held up for the whole snapshot."""
    shard = DirectoryShard()
    for r in "abcd":
        shard.apply_events(r, 0, chain(3, r))
    follower = IndexFollower([LocalShard(shard)])

    async def go() -> list[int]:
        seen: list[int] = []

        async def decisions():
            for _ in range(20):
                seen.append(len(follower.index.replicas()))
                await asyncio.sleep(0)

        task = asyncio.create_task(decisions())
        await asyncio.sleep(0)
        await follower.poll_once()                         # a new follower: a snapshot
        await task
        return seen

    seen = asyncio.run(go())
    assert any(0 < n < 4 for n in seen), seen
    assert follower.index.replicas() == list("abcd")


def test_a_snapshot_keeps_the_follower_at_full_pace():
    """A snapshot (a new router, a restarted directory) means the fleet's views just changed:
    the follower polls at full pace after it, as after entries, not at the idle pace."""
    now = [10.0]
    shard = DirectoryShard()
    shard.apply_events("a", 0, chain(2, "a"))
    follower = IndexFollower([LocalShard(shard)], idle_after_s=1.0, clock=lambda: now[0])
    now[0] = 20.0
    assert follower.idle()
    asyncio.run(follower.poll_once())                   # a new follower: a snapshot
    assert follower.counters.snapshots == 1 and not follower.idle()
