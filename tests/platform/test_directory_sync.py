"""The prefix directory mirrors the replicas' caches (allowing only for event lag), and a
replica's sync with it never waits while holding the engine lock."""

from __future__ import annotations

import asyncio
import gc
import random
import time

import ray

from kvharbor.platform.protocol import GenerateRequest
from tests.conftest import DEMO


def _directory_matches_replicas(app) -> tuple[bool, dict]:
    caches = {rid: set(r["cached"]) for rid, r in app.replica_call("check_integrity").items()}
    directory = app.directory()
    seen = {rid: ray.get(directory.replica_hashes.remote(rid)) for rid in caches}
    return all(seen[rid] == caches[rid] for rid in caches), {r: (len(seen[r]), len(caches[r])) for r in caches}


def test_directory_equals_union_of_replica_caches(kvharbor_app):
    rng = random.Random(3)
    with kvharbor_app.client(DEMO["standard"]) as c:
        for i in range(12):
            prompt = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randint(40, 400)))
            r = c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": prompt,
                                                "max_tokens": 3})
            assert r.status_code == 200
    deadline = time.time() + 15
    ok, sizes = _directory_matches_replicas(kvharbor_app)
    while not ok and time.time() < deadline:
        time.sleep(0.5)
        ok, sizes = _directory_matches_replicas(kvharbor_app)
    assert ok, f"directory vs replica cache sizes: {sizes}"
    assert all(n > 0 for n, _ in sizes.values()), "both replicas should hold cached blocks"
    ray.get(kvharbor_app.directory().check_integrity.remote())


# ---- DirectorySync without Ray: a fake directory handle -----------------------------------
class _Method:
    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def remote(self, *args):
        self.owner.calls.append((self.name, *args))
        fut = asyncio.get_running_loop().create_future()
        if self.owner.hang:
            return fut                          # never answers
        try:
            fut.set_result(getattr(self.owner.shard, self.name)(*args))
        except Exception as exc:                # as a Ray call: raised where it is awaited
            fut.set_exception(exc)
        return fut


class FakeDirectoryHandle:
    """Stands in for the actor handle: ``x.remote(...)`` answers from a DirectoryShard."""

    def __init__(self, hang: bool = False) -> None:
        from kvharbor.actors.prefix_directory import DirectoryShard

        self.shard, self.hang, self.calls = DirectoryShard(), hang, []

    def __getattr__(self, name):
        return _Method(self, name)


def _engine():
    from kvharbor.config import EngineConfig
    from kvharbor.engine.engine import Engine

    return Engine(EngineConfig(device="cpu", num_kv_blocks=64, dtype="float32"))


def _run_prompt(engine, rid: str, tokens: list[int]) -> None:
    from kvharbor.engine.request import SamplingParams

    engine.add_request(rid, tokens, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def _synced_engine():
    """An engine, a fake directory handle and the DirectorySync between them."""
    from kvharbor.actors.replica_sync import DirectorySync

    engine, handle = _engine(), FakeDirectoryHandle()
    sync = DirectorySync("d", "rep")
    sync._handle = handle
    return engine, handle, sync


async def tick(sync, engine) -> None:
    """One tick of the replica's directory sync: prepare a batch, then settle it."""
    ref = sync.prepare(engine)
    await sync.settle(ref)


def test_sync_resyncs_then_streams_batches_and_recovers_from_a_restarted_directory():
    engine, handle, sync = _synced_engine()

    async def go():
        _run_prompt(engine, "a", list(range(100)))
        await tick(sync, engine)                                   # start: snapshot
        assert handle.shard.replica_hashes("rep") == engine.cached_block_hashes() != set()
        _run_prompt(engine, "b", list(range(50, 150)))
        sync.publish(engine)                           # batches after the snapshot
        await tick(sync, engine)
        assert handle.shard.replica_hashes("rep") == engine.cached_block_hashes()
        handle.shard = type(handle.shard)()            # the directory restarted, empty
        await tick(sync, engine)                                   # heartbeat: unknown -> resync due
        await tick(sync, engine)
        assert handle.shard.replica_hashes("rep") == engine.cached_block_hashes()

    asyncio.run(go())
    assert sync.resyncs == 2


def test_a_hanging_directory_times_out_and_never_holds_the_engine_lock():
    from kvharbor.actors.replica import LLMReplica

    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64, "dtype": "float32"},
                         directory_name="unused")
    replica.directory._handle = FakeDirectoryHandle(hang=True)
    replica.directory.timeout_s = 30.0

    async def go():
        import kvharbor.actors.replica as replica_module

        replica_module.STATS_PERIOD_S = 0.05
        replica._ensure_loop()
        await asyncio.sleep(0.3)                      # background task is stuck in settle
        assert replica.directory._handle.calls, "the background task should have called"
        assert not replica._engine_lock.locked()
        request = GenerateRequest(request_id="x", tenant="t", qos="standard",
                                  prompt_token_ids=list(range(40)), block_hashes=[],
                                  sampling={"max_tokens": 4, "temperature": 0,
                                            "ignore_eos": True})
        events = await asyncio.wait_for(_collect(replica.generate(request)), 10)
        assert events[-1]["finish_reason"] is not None
        replica._loop_task.cancel()
        replica._bg_task.cancel()

    try:
        asyncio.run(go())
    finally:
        import kvharbor.actors.replica as replica_module

        replica_module.STATS_PERIOD_S = 1.0


async def _collect(stream) -> list:
    return [event async for event in stream]


def test_settle_times_out_and_marks_a_resync():
    from kvharbor.actors.replica_sync import DirectorySync

    engine, handle = _engine(), FakeDirectoryHandle(hang=True)
    sync = DirectorySync("d", "rep", timeout_s=0.05)
    sync._handle = handle

    async def go():
        ref = sync.prepare(engine)
        assert ref is not None and not sync._resync_due
        start = time.perf_counter()
        await sync.settle(ref)
        return time.perf_counter() - start

    assert asyncio.run(go()) < 1.0
    assert sync._resync_due


def test_a_refused_or_failed_batch_makes_the_next_tick_resync_both_tiers():
    """A batch the directory refused (it saw a gap) or that failed leaves the directory's view
    of this replica incomplete even while its heartbeat still knows the replica: the next tick
    sends a snapshot, of the host tier too."""
    from kvharbor.actors.replica_sync import DirectorySync
    from kvharbor.config import EngineConfig
    from kvharbor.engine.engine import Engine

    engine = Engine(EngineConfig(device="cpu", num_kv_blocks=16, host_kv_blocks=64,
                                 dtype="float32"))
    handle = FakeDirectoryHandle()
    sync = DirectorySync("d", "rep")
    sync._handle = handle

    def publish_losing_every_batch(how):
        """The directory refuses (it saw a gap) or fails every batch of this publish."""
        def lost(*args):
            if how == "fail":
                raise ConnectionError("the call failed")
            return False

        apply, handle.shard.apply_events = handle.shard.apply_events, lost
        sync.publish(engine)
        handle.shard.apply_events = apply

    async def go():
        await tick(sync, engine)                                   # start: snapshot
        for i, how in enumerate(["refuse", "fail"]):
            for j in range(4):                         # more than the 16 device blocks hold
                rng = random.Random(10 * i + j)
                _run_prompt(engine, f"{how}{j}", [rng.randrange(250) for _ in range(96)])
            publish_losing_every_batch(how)
            await tick(sync, engine)                               # the loss is seen
            await tick(sync, engine)                               # the snapshot
            assert engine.host_block_hashes(), "the host tier should hold evicted blocks"
            view = handle.shard.snapshot()["snapshot"]["rep"][1]
            assert set(view["device"]) == engine.cached_block_hashes(), how
            assert set(view["host"]) == engine.host_block_hashes(), how

    asyncio.run(go())
    assert sync.resyncs == 3


def test_batches_and_resyncs_tell_the_directory_whether_the_cache_is_prefix_closed():
    """The directory matches a replica by bisection only while the replica says its cache is
    prefix-closed: a cache reset that drops a parent but keeps its children must reach the
    directory as "not closed", by batch and by resync, and a later reset as "closed"."""
    engine, handle, sync = _synced_engine()

    async def go():
        _run_prompt(engine, "a", list(range(100)))
        await tick(sync, engine)                                   # start: snapshot
        assert handle.shard._index.is_closed("rep") and engine.pool.prefix_closed
        first = next(h for h, b in engine.pool.cached.items() if b.parent_hash is None)
        assert engine.pool.evict_all_cached(lambda h: h == first) == 1   # a parent only
        assert not engine.pool.prefix_closed
        sync.publish(engine)
        await tick(sync, engine)
        assert handle.shard.replica_hashes("rep") == engine.cached_block_hashes()
        assert not handle.shard._index.is_closed("rep")
        handle.shard = type(handle.shard)()                        # restarted: a resync
        await tick(sync, engine)
        await tick(sync, engine)
        assert handle.shard.replica_hashes("rep") == engine.cached_block_hashes() != set()
        assert not handle.shard._index.is_closed("rep")
        engine.pool.evict_all_cached()                             # the orphans go too
        assert engine.pool.prefix_closed
        sync.publish(engine)
        await tick(sync, engine)
        assert handle.shard._index.is_closed("rep")

    asyncio.run(go())


def test_a_snapshot_alone_carries_the_events_it_covers():
    """While a snapshot is due no batch is sent (the directory, awaiting it, would refuse the
    batch and the refusal would ask for yet another snapshot), and events the snapshot covers
    are not sent again after it."""
    engine, handle, sync = _synced_engine()

    def sent():
        return [call[0] for call in handle.calls]

    async def go():
        _run_prompt(engine, "a", list(range(100)))
        sync.publish(engine)                             # a snapshot is due: nothing sent
        assert sent() == []
        _run_prompt(engine, "b", list(range(50, 150)))   # events after the last publish
        await tick(sync, engine)
        assert sent() == ["resync", "heartbeat"]
        sync.publish(engine)                             # nothing happened since the snapshot
        await tick(sync, engine)
        assert sent() == ["resync", "heartbeat", "heartbeat"]
        assert handle.shard.replica_hashes("rep") == engine.cached_block_hashes() != set()

    asyncio.run(go())
    assert sync.resyncs == 1


def test_a_failed_snapshot_is_sent_again_at_the_next_tick():
    """A snapshot call that failed leaves the directory's view as it was, even when its
    heartbeat still knows the replica: the next tick sends another."""
    engine, handle, sync = _synced_engine()

    async def go():
        _run_prompt(engine, "a", list(range(100)))
        await tick(sync, engine)                                   # start: snapshot
        _run_prompt(engine, "b", list(range(50, 150)))
        resync, calls = handle.shard.resync, []

        def flaky(*args):
            calls.append(args)
            if len(calls) == 1:
                raise ConnectionError("the call failed")
            return resync(*args)

        handle.shard.resync = flaky
        sync._resync_due = True                                    # e.g. after a gap
        await tick(sync, engine)                                   # fails; the heartbeat knows "rep"
        due = sync._resync_due
        await tick(sync, engine)
        return due

    due = asyncio.run(go())
    gc.collect()          # a call's unretrieved error is logged now, not while pytest reports
    assert due, "the failed snapshot was not sent again"
    assert handle.shard.replica_hashes("rep") == engine.cached_block_hashes()
    assert sync.resyncs == 3


def test_a_replica_closing_makes_the_directory_forget_it():
    engine, handle, sync = _synced_engine()

    async def go():
        _run_prompt(engine, "a", list(range(100)))
        await tick(sync, engine)
        assert handle.shard.replicas() == ["rep"]
        sync.close()
        await asyncio.sleep(0)

    asyncio.run(go())
    assert handle.shard.replicas() == [] and ("remove_replica", "rep") in handle.calls
