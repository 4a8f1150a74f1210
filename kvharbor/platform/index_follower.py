"""A router's own replica of the prefix index, kept current from the directory's event log.

::

    replicas ──KV event batches──▶ PrefixDirectory shard i  (index + EventLog, epoch E_i)
                                        │ poll(E_i, cursor) every poll_interval_s
                                        ▼
    router process:  IndexFollower ──replay──▶ local PrefixIndex ◀── match() per decision
                                                (no remote call on the routing path)

Each shard is followed independently (replicas of different shards never share entries,
so the order between shards does not matter). A shard answers a poll with the entries
after the cursor, or with a snapshot when the follower is new, fell behind the bounded log,
or the shard restarted (new epoch). A snapshot replaces the views of the replicas it lists;
after a restart it keeps the views of replicas the new shard has not heard from yet (they
resync within a heartbeat), so a directory crash does not blank the router's index.

Replay is checked: every "events" entry must be the next batch the local index expects
(the directory already ordered them). A mismatch means the follower lost an entry; it
forgets its cursor and takes a snapshot on the next poll.

Pace: a poll every ``poll_interval_s`` while entries arrive or the router is routing, and
every ``idle_poll_interval_s`` once nothing has happened for ``idle_after_s`` (each poll is an
actor call: at 20 ms, empty polls cost an idle gateway 6.8 % of a core and the directory 4.5 %,
``scripts/app_cpu.py``). ``hurry()`` (the router calls it for every request it routes) cuts an idle
pause short and polls fast again, so the events of the router's own traffic arrive as before;
events caused by other routers' traffic after an idle spell arrive within the idle interval.

``status()`` is None while every shard answered within ``stale_after_s``; otherwise the
reason the router should not trust the index ("stream_not_started" / "stream_stale").
All methods run on the router's event loop; nothing here blocks it (the actor lookup runs
in a worker thread, every remote call is awaited with a timeout). Changes to the index are
made holding ``lock`` (the router's, so that a decision made on another thread never reads
the index half-changed); it is never held across an ``await``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvharbor.actors.prefix_directory import DEFAULT_MAX_BLOCKS, PrefixIndex, shard_of

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ShardState:
    """Where the follower stands in one shard's log."""

    epoch: str | None = None
    cursor: int = 0
    synced_at: float | None = None      # monotonic time of the last successful poll
    failures: int = 0


@dataclass(slots=True)
class FollowerCounters:
    polls: int = 0
    poll_errors: int = 0
    entries: int = 0
    snapshots: int = 0
    mismatches: int = 0


class ActorShard:
    """One directory shard reached by actor name: lookup in a thread, calls with a timeout."""

    def __init__(self, name: str, namespace: str | None, timeout_s: float,
                 retry_s: float = 5.0, handle: Any = None) -> None:
        self.name, self.namespace = name, namespace
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self._handle = handle
        self._retry_at = 0.0

    async def poll(self, epoch: str | None, cursor: int, max_entries: int) -> dict:
        handle = self._handle or await self._look_up()
        try:
            return await asyncio.wait_for(handle.poll.remote(epoch, cursor, max_entries),
                                          self.timeout_s)
        except asyncio.TimeoutError:
            raise
        except Exception:
            self._handle = None           # dead or restarting: look it up again later
            self._retry_at = time.monotonic() + min(self.retry_s, 0.5)
            raise

    async def call(self, method: str, *args) -> Any:
        """Any other directory method (control plane), with the same timeout."""
        handle = self._handle or await self._look_up()
        return await asyncio.wait_for(getattr(handle, method).remote(*args), self.timeout_s)

    async def _look_up(self):
        if time.monotonic() < self._retry_at:
            raise LookupError(f"prefix directory {self.name!r} not found yet")
        try:
            self._handle = await asyncio.wait_for(asyncio.to_thread(self._get_actor),
                                                  self.timeout_s)
        except Exception:
            self._retry_at = time.monotonic() + self.retry_s
            raise
        return self._handle

    def _get_actor(self):
        import ray

        return ray.get_actor(self.name, namespace=self.namespace)


def ray_initialized() -> bool:
    """Whether this process's Ray is up. A function of this module so that tests stand in for
    it here: patching ``ray.is_initialized`` itself, even for 50 ms, makes every actor call
    another thread of the process makes meanwhile try ``ray.init()`` and raise, and Serve's
    shared long-poll client dies on that error (its handles then never learn of a replaced
    replica again)."""
    import ray  # noqa: PLC0415 - in-process shards never need Ray

    return ray.is_initialized()


class IndexFollower:
    """Local ``PrefixIndex`` fed by polling each directory shard (see module doc)."""

    def __init__(self, shards: Sequence, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 poll_interval_s: float = 0.02, stale_after_s: float = 2.0,
                 max_entries: int = 1024, on_stored: Callable | None = None,
                 on_resync: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 idle_poll_interval_s: float = 0.2, idle_after_s: float = 1.0,
                 lock: contextlib.AbstractContextManager | None = None) -> None:
        """Args:
            shards: objects with ``async poll(epoch, cursor, max_entries) -> dict``, shard i
                holding the replicas ``shard_of(replica, len(shards)) == i``.
            max_blocks: bound of the local index (same meaning as ``PrefixIndex``).
            poll_interval_s: pause between polls of all shards.
            stale_after_s: a shard not answered for this long makes ``status()`` stale.
            idle_poll_interval_s: the pause instead, once no poll brought entries and no
                ``hurry()`` came for ``idle_after_s`` (at most ``stale_after_s``).
            on_stored: ``f(replica, hashes)`` for every store replayed or taken from a
                snapshot (the router confirms its active blocks with it).
            on_resync: ``f(kind)`` for every snapshot or replay mismatch (metrics).
            lock: held while the index changes (a ``threading.RLock`` shared with readers
                on other threads); none by default.
        """
        self.shards = list(shards)
        self.index = PrefixIndex(max_blocks)
        self.poll_interval_s, self.stale_after_s = poll_interval_s, stale_after_s
        self.max_entries = max_entries
        self.on_stored, self.on_resync = on_stored, on_resync
        self.clock = clock
        self.idle_poll_interval_s = min(max(idle_poll_interval_s, poll_interval_s), stale_after_s)
        self.idle_after_s = idle_after_s
        self.state = [ShardState() for _ in self.shards]
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self.counters = FollowerCounters()
        self._active_at = -float("inf")          # last poll with entries, or last hurry()
        self._wake: asyncio.Event | None = None   # set by hurry() during an idle pause

    # ---- health ------------------------------------------------------------------------
    def status(self) -> str | None:
        """None when the index can be trusted; else why not (a metric label)."""
        now, stale = self.clock(), None
        for s in self.state:                  # a loop, not any(): on every routing decision
            if s.synced_at is None:
                return "stream_not_started"
            if now - s.synced_at > self.stale_after_s:
                stale = "stream_stale"
        return stale

    def lag_s(self) -> float:
        """Seconds since the shard heard from least recently last answered (inf: never)."""
        now = self.clock()
        return max((now - s.synced_at if s.synced_at is not None else float("inf"))
                   for s in self.state) if self.state else 0.0

    # ---- polling -----------------------------------------------------------------------
    async def run(self, after_poll: Callable[[], None] | None = None) -> None:
        """Poll every shard until ``ray_shut_down()`` (run as a task on an event loop);
        ``after_poll`` is called after each poll (a router marks its first poll, records lag)."""
        while not self.ray_shut_down():
            await self.poll_once()
            if after_poll is not None:
                after_poll()
            await self.pause()

    def ray_shut_down(self) -> bool:
        """Some shard is a Ray actor and this process's Ray is shut down: a follower left in a
        driver (a test, a script holding a handle) must stop polling then, or its actor call
        makes Ray start a new local cluster while the interpreter exits."""
        if not any(isinstance(s, ActorShard) for s in self.shards):
            return False
        return not ray_initialized()

    def idle(self) -> bool:
        """No entries and no ``hurry()`` for ``idle_after_s``: polls slow down."""
        return self.clock() - self._active_at > self.idle_after_s

    async def pause(self) -> None:
        """Wait before the next poll (see the module doc): ``poll_interval_s``, or while
        ``idle()`` up to ``idle_poll_interval_s``, cut short by ``hurry()``."""
        if not self.idle():
            await asyncio.sleep(self.poll_interval_s)
            return
        self._wake = wake = asyncio.Event()
        try:
            await asyncio.wait_for(wake.wait(), self.idle_poll_interval_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._wake = None

    def hurry(self) -> None:
        """Events are coming (the router just routed a request): poll at full pace again,
        starting now if an idle pause is under way. Call on the follower's event loop."""
        self._active_at = self.clock()
        if self._wake is not None:
            self._wake.set()

    async def poll_once(self) -> None:
        """One poll of every shard; failures are counted, logged once, and retried later."""
        for i, shard in enumerate(self.shards):
            st = self.state[i]
            self.counters.polls += 1
            try:
                reply = await shard.poll(st.epoch, st.cursor, self.max_entries)
            except Exception as exc:  # noqa: BLE001 - timeout, dead or missing directory
                self.counters.poll_errors += 1
                st.failures += 1
                if st.failures == 1:
                    logger.warning("prefix directory shard %d poll failed: %r", i, exc)
                continue
            st.failures = 0
            await self.apply(i, reply)

    async def apply(self, shard: int, reply: dict) -> None:
        """Apply one poll reply of ``shard`` (entries or a snapshot)."""
        st = self.state[shard]
        if "snapshot" in reply:
            await self._apply_snapshot(shard, reply, restarted=st.epoch not in (None, reply["epoch"]))
        else:
            if reply["entries"]:
                self._active_at = self.clock()
            with self._lock:
                for entry in reply["entries"]:
                    if not self._replay(shard, entry):
                        self.counters.mismatches += 1
                        self._notify("replay_mismatch")
                        st.epoch, st.cursor = None, 0          # snapshot on the next poll
                        return
            self.counters.entries += len(reply["entries"])
        st.epoch, st.cursor, st.synced_at = reply["epoch"], reply["cursor"], self.clock()

    def forget_replica(self, replica_id: str) -> None:
        """Drop a replica Serve says is gone (the directory is told separately; the router
        holds its lock around this)."""
        self.index.remove_replica(replica_id)

    # ---- internals ---------------------------------------------------------------------
    def _replay(self, shard: int, entry: tuple) -> bool:
        kind = entry[0]
        if kind == "events":
            replica, seq_no, stored, removed, tier = entry[1:6]
            closed = entry[6] if len(entry) > 6 else None
            status = self.index.apply_batch(replica, seq_no, stored, removed, tier, closed)
            if status != "applied":
                return False
            if self.on_stored is not None and stored:
                self.on_stored(replica, stored)
        elif kind == "resync":
            replica, seq_no, tiers = entry[1:4]
            self.index.resync(replica, seq_no, tiers, len(entry) > 4 and bool(entry[4]))
            if self.on_stored is not None:
                self.on_stored(replica, [h for hs in tiers.values() for h in hs])
        elif kind == "remove":
            self.index.remove_replica(entry[1])
        elif kind == "clear":
            self._drop_shard_replicas(shard, keep=())
        return True

    async def _apply_snapshot(self, shard: int, reply: dict, restarted: bool) -> None:
        """Replace the views of the replicas in the snapshot, yielding between replicas.

        After a restart (new epoch) replicas missing from the snapshot keep their views
        until they resync; otherwise a replica missing from it is forgotten.
        """
        snapshot = reply["snapshot"]
        self._active_at = self.clock()
        self.counters.snapshots += 1
        self._notify("router_snapshot")
        if not restarted:
            with self._lock:
                self._drop_shard_replicas(shard, keep=snapshot)
        closed = set(reply.get("closed", ()))
        for replica, (seq_no, tiers) in snapshot.items():
            with self._lock:
                self.index.resync(replica, seq_no, tiers, replica in closed)
                if self.on_stored is not None:
                    self.on_stored(replica, [h for hs in tiers.values() for h in hs])
            await asyncio.sleep(0)             # let routing decisions run in between

    def _drop_shard_replicas(self, shard: int, keep) -> None:
        n = len(self.shards)
        for replica in self.index.replicas():
            if shard_of(replica, n) == shard and replica not in keep:
                self.index.remove_replica(replica)

    def _notify(self, kind: str) -> None:
        if self.on_resync is not None:
            self.on_resync(kind)
