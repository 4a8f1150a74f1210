"""KVAwareRouter: Ray Serve request router that sends a prompt where its prefix is cached.

Set on the LLMReplica deployment::

    request_router_config=RequestRouterConfig(
        request_router_class="kvharbor.platform.router:KVAwareRouter",
        request_router_kwargs={"directory_name": "kvharbor-prefix-directory",
                               "directory_namespace": "kvharbor"},
        request_routing_stats_period_s=1.0)

Every process that owns a handle to the deployment has its own router, and each router
holds its own replica of the prefix index (``IndexFollower``), fed by the directory's event
log in a background task. One routing attempt (``choose_replicas``) makes no remote call::

    GenerateRequest (args[0] or kwargs["request"])
        │ block_hashes ──local index.match──▶ {replica: MatchInfo}      (event stream live)
        │              ──routing history────▶ {replica: MatchInfo}      (approximate mode)
        │ + active blocks (sent here, no event yet): extend the match, count as load
        │ each candidate: routing_stats; load = Serve's in-flight count, capped by what
        │                 the replica last reported + what this router sent it since
        ▼
    KVAwarePolicy.rank ──▶ [[best], [second], [all the rest]]
                            (Serve tries each rank in turn; a full replica is skipped)

Session affinity: a request with ``session_id`` prefers the replica that holds the session:
the one this router last sent the session to (``_sessions``, fresh) if still a candidate,
else one whose routing stats list the session's key (reported by replicas, so turns routed
by another gateway's router are found too). The policy keeps the load guard; when no live
replica holds the session, the prefix index decides as for any request. A request with
``prompt_cache_key`` prefers that key's home (``routing_policy``: a rendezvous hash of the
tenant and key over the live replicas, so every router picks the same one), also when it
has no block hashes to match.

The follower starts with the router; a router's first decision waits for its first poll (at
most ``FIRST_POLL_WAIT_S``, once), so a gateway replica that has not routed yet still routes
by the index. Degrading: no hashes -> power of two; event stream not started or stale -> approximate
mode (this router's own routing history, like SGLang's router); no history either ->
power of two. Replicas named in ``metadata["exclude_replicas"]`` (the gateway's retry after
a replica failed) are skipped while any other candidate remains.

The decision is written into ``request.metadata`` before the request is sent, so the
replica can compare predicted and observed prefix hits:

    router_policy                   "kv_aware" (index), "approx" or "pow2_fallback"
    router_fallback_reason          why not the index ("no_hashes", "stream_stale", ...)
    router_decision_ms              time spent in choose_replicas (float ms, wall clock)
    router_decision_cpu_ms          CPU time of this thread in it (excludes waits for the
                                    GIL or the OS scheduler on a busy machine)
    router_predicted_cached_tokens  cached tokens predicted on the top-ranked replica
    router_predicted_by_replica     {replica unique_id: predicted cached tokens} (hits only)
    router_session_affinity         True when the top choice was the replica holding the session
    router_cache_key_affinity       True when the top choice was the home of its prompt_cache_key
    routed_to                       unique id of the replica that accepted the request
                                    (set after the send, in the caller's process)
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import random
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvharbor.actors.calls import on_event_loop, start_background
from kvharbor.actors.prefix_directory import DEFAULT_DIRECTORY_NAME, DEFAULT_MAX_BLOCKS, shard_name
from kvharbor.observability.metrics import get_metrics
from kvharbor.platform.active_blocks import ActiveBlocks, RoutingHistory, with_active
from kvharbor.platform.index_follower import ActorShard, IndexFollower
from kvharbor.platform.protocol import GenerateRequest, session_key
from kvharbor.platform.routing_policy import (NO_STATS, Candidate, KVAwarePolicy,
                                              PowerOfTwoPolicy, RouteRequest, RoutingPolicy)

logger = logging.getLogger(__name__)

POLICY_LABEL = {"kv_index": "kv_aware", "approx": "approx", "pow2": "pow2_fallback"}
FIRST_POLL_WAIT_S = 0.5           # a new router's first decision waits this long for the index
MAX_SESSIONS = 65536              # sessions this router remembers the replica of (LRU)
STATS_FRESH_S = 2.0               # routing stats younger than this give a replica's load


def pinned_replica(pending_request: PendingRequest | None,
                   candidates: list[RunningReplica]) -> RunningReplica | None:
    """The replica named by a ``replica_id=`` keyword (admin and test calls), if any."""
    wanted = pending_request.kwargs.get("replica_id") if pending_request is not None else None
    if wanted is None:
        return None
    return next((r for r in candidates if r.replica_id.unique_id == wanted), None)


def generate_request_of(pending_request: PendingRequest | None) -> GenerateRequest | None:
    """The ``GenerateRequest`` a handle call carries, or None if it carries none."""
    if pending_request is None:
        return None
    for arg in list(pending_request.args[:1]) + [pending_request.kwargs.get("request")]:
        if isinstance(arg, GenerateRequest):
            return arg
    return None


class _LiveRouters(weakref.WeakSet):
    """The routers alive in this process. Ray Serve pickles a request router's class *by
    value* (its module registered with cloudpickle) whenever it serializes the deployment's
    config, e.g. in ``serve.status()``; a pickled copy starts empty instead of carrying the
    live routers, whose asyncio tasks cannot be pickled."""

    def __reduce__(self):
        return type(self), ()


_LIVE_ROUTERS = _LiveRouters()
"""Read and written through this module itself (``_live_routers()``), never through the
class or a function's globals: unpickling the class by value in this process resets the
class's attributes and gives its methods copies of these globals."""


def _live_routers() -> _LiveRouters:
    import kvharbor.platform.router as module

    return module._LIVE_ROUTERS


class KVAwareRouter(RequestRouter):
    """Prefix-cache-aware, load-balanced routing for ``LLMReplica`` (see module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initialize_state()
        _live_routers().add(self)

    @classmethod
    def instances(cls) -> list["KVAwareRouter"]:
        """Routers alive in this process (tests and benchmarks read their index)."""
        return list(_live_routers())

    def initialize_state(self, directory_name: str = DEFAULT_DIRECTORY_NAME,
                         directory_namespace: str | None = None, num_directory_shards: int = 1,
                         poll_interval_s: float = 0.02, stale_after_s: float = 2.0,
                         idle_poll_interval_s: float = 0.2,
                         control_timeout_s: float = 2.0, lookup_retry_s: float = 5.0,
                         max_index_blocks: int = DEFAULT_MAX_BLOCKS, active_ttl_s: float = 5.0,
                         num_single_ranks: int = 2, default_block_size: int = 16,
                         policy: dict | None = None, **unknown: Any) -> None:
        """Configure from ``request_router_kwargs`` (every argument is JSON-serializable).

        Args:
            directory_name / directory_namespace: the named PrefixDirectory actor(s).
            num_directory_shards: shards of the directory (``shard_name`` names them).
            poll_interval_s: pause between polls of the directory's event log.
            idle_poll_interval_s: the pause once the log has been quiet and this router has
                routed nothing for a second (``IndexFollower``); a decision resets it.
            stale_after_s: log not reached for this long -> approximate mode.
            control_timeout_s: longest wait for any directory call (lookup, poll, remove).
            lookup_retry_s: how long to wait before looking a missing directory up again.
            max_index_blocks: bound on the local index ((hash, replica) entries).
            active_ttl_s: how long a sent block counts as active without a stored event.
            num_single_ranks: how many best replicas get a rank of their own before the
                rest share the last rank (Serve picks the least queued in a shared rank).
            default_block_size: used when a replica has not reported ``block_size`` yet.
            policy: keyword arguments for ``KVAwarePolicy`` (e.g. ``load_cost_tokens``).
        """
        if unknown:
            raise ValueError(f"unknown KVAwareRouter kwargs {sorted(unknown)}; see "
                             "KVAwareRouter.initialize_state for the accepted names")
        if (num_single_ranks < 1 or default_block_size < 1 or num_directory_shards < 1
                or min(poll_interval_s, idle_poll_interval_s, stale_after_s, control_timeout_s) <= 0):
            raise ValueError("num_single_ranks, default_block_size and num_directory_shards "
                             "must be >= 1; poll_interval_s, idle_poll_interval_s, "
                             "stale_after_s and control_timeout_s must be > 0")
        old = getattr(self, "_follow_task", None)
        if old is not None:
            old.cancel()
        self._follow_task: asyncio.Task | None = None
        self._first_poll: asyncio.Event | None = None    # set once the follower polled once
        self.metrics = get_metrics()
        self.active = ActiveBlocks(active_ttl_s)
        self._guesses: OrderedDict[str, tuple] = OrderedDict()   # request -> (replica, hashes)
        self._sent: dict[str, deque[float]] = {}     # replica -> times this router sent it a request
        self._direct: dict[str, int] = {}            # replica -> direct streams open to it
        self._home_loop: asyncio.AbstractEventLoop | None = None   # the loop Serve routes on
        self.history = RoutingHistory(max_index_blocks)
        # Held while this router's state changes or a decision reads it: Serve's decisions and
        # the follower run on the router's loop, a direct stream's decision on the caller's.
        self._state_lock = threading.RLock()
        self.shards = [ActorShard(shard_name(directory_name, i, num_directory_shards),
                                  directory_namespace, control_timeout_s, lookup_retry_s)
                       for i in range(num_directory_shards)]
        self.follower = IndexFollower(self.shards, max_index_blocks, poll_interval_s,
                                      stale_after_s, on_stored=self._confirmed,
                                      on_resync=self.metrics.directory_resync,
                                      idle_poll_interval_s=idle_poll_interval_s,
                                      lock=self._state_lock)
        self._sessions: OrderedDict[str, str] = OrderedDict()    # session key -> replica
        self._stats_sessions: dict[str, tuple[list, frozenset]] = {}   # replica -> (list, keys)
        self.policy: RoutingPolicy = KVAwarePolicy(**(policy or {}))
        self.fallback = PowerOfTwoPolicy(random.Random())
        self.num_single_ranks = num_single_ranks
        self.default_block_size = default_block_size
        if on_event_loop():              # else not on the router's loop: start on the first decision
            self._ensure_following()     # follow from the start, not from the first request

    # ---- Serve hooks -----------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set; replicas that left it are forgotten here and in the
        directory (Serve's controller is the authority on which replicas are alive)."""
        gone = ({r.unique_id for r in self.curr_replicas}
                - {r.replica_id.unique_id for r in replicas})
        super().update_replicas(replicas)
        for uid in gone:
            self._forget(uid)

    def on_replica_actor_died(self, replica_id) -> None:
        """A request found the replica dead before Serve's next update: forget it now."""
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """The replica accepted the request: remember where it went (history, active blocks)."""
        request = generate_request_of(pending_request)
        if request is not None:
            self._routed(replica_id.unique_id, request,
                         pending_request.metadata.internal_request_id)

    def _routed(self, uid: str, request: GenerateRequest, key: str) -> None:
        """Book a send of ``request`` (``key``: its decision's) to replica ``uid``."""
        with self._state_lock:
            self._book(uid, request, key)

    def _book(self, uid: str, request: GenerateRequest, key: str) -> None:
        request.metadata["routed_to"] = uid
        sent = self._sent.setdefault(uid, deque())
        now = time.time()
        sent.append(now)
        while sent and sent[0] < now - STATS_FRESH_S:
            sent.popleft()
        guess = self._guesses.pop(key, None)
        if guess is not None and guess[0] != uid:     # Serve took a lower rank
            self.active.discard(guess[0], guess[1])
            self.active.add(uid, guess[1])
        self.history.record(uid, request.block_hashes)
        if request.session_id:
            key = session_key(request.tenant, request.session_id)
            self._sessions[key] = uid
            self._sessions.move_to_end(key)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """Rank ``candidate_replicas`` for ``pending_request`` (one routing attempt)."""
        if not candidate_replicas:
            return []
        await self._before_decision()
        target = pinned_replica(pending_request, candidate_replicas)
        if target is not None:
            return [[target]]
        if pending_request is None:
            return self._rank(candidate_replicas, None, None)
        pending_request.routing_context.should_backoff = True  # sleep between attempts
        return self._rank(candidate_replicas, generate_request_of(pending_request),
                          pending_request.metadata.internal_request_id)

    async def _before_decision(self) -> None:
        self._ensure_following()
        self.follower.hurry()                 # this request's KV events follow within steps
        if self._first_poll is not None and not self._first_poll.is_set():
            await self._await_first_poll()

    def _rank(self, candidate_replicas: list[RunningReplica], request: GenerateRequest | None,
              key: str | None) -> list[list[RunningReplica]]:
        """One routing decision (``key`` names it until the send is booked)."""
        with self._state_lock:
            return self._decide(candidate_replicas, request, key)

    def _decide(self, candidate_replicas: list[RunningReplica], request: GenerateRequest | None,
                key: str | None) -> list[list[RunningReplica]]:
        start, start_cpu = time.perf_counter(), time.thread_time()
        candidate_replicas = _without_excluded(request, candidate_replicas)
        mode, reason, matches = self._matches(request)
        holder = self._session_holder(request, candidate_replicas)
        candidates = self._candidates(candidate_replicas, matches, request, holder)
        route = self._route_request(request, candidates)
        if mode != "pow2" or holder is not None or route.cache_key:
            ranked = self.policy.rank(route, candidates)
            ranks = self._kv_ranks(ranked, candidate_replicas)
        else:
            ranked = self.fallback.rank(route, candidates)
            ranks = [self._by_ids(ranked[:2], candidate_replicas)]
        if request is not None:
            self._note_active(key, request, ranked, route.block_size, mode)
            self._record(request, ranked, mode, reason, start, start_cpu)
        self.metrics.router_mode(mode, reason)
        if ranked and (ranked[0].session or ranked[0].cache_key):
            self.metrics.router_affinity("session" if ranked[0].session else "cache_key")
        return ranks

    # ---- direct streams (kvharbor.platform.direct_stream) -----------------------------------
    @classmethod
    def for_handle(cls, handle) -> "KVAwareRouter | None":
        """The router of ``handle``'s deployment in this process, once it has routed or
        followed on its loop (else None: the handle's first call creates and starts it)."""
        for router in cls.instances():
            dep = getattr(router, "_deployment_id", None)
            if (router._home_loop is not None and dep is not None
                    and dep.name == handle.deployment_name and dep.app_name == handle.app_name):
                return router
        return None

    async def route_direct(self, request: GenerateRequest,
                           replica_id: str | None = None) -> tuple[str, list] | None:
        """From any event loop: the replica for ``request`` among those that listen for direct
        streams (``replica_id``: that one only), ranked as ``choose_replicas`` ranks, with the
        send booked; ``(replica unique id, [host, port, token hex])``, or None (none listens,
        or this router's loop is gone): the caller takes Serve's path.

        Once the router follows the index (its first poll done), the decision is made here, on
        the caller's loop, when the router's state lock is free, instead of waiting its turn on
        the router's loop, which Serve's routing of every other request keeps busy (under a 2x
        flood through one gateway the hop took 20 ms p50, 100 ms p99, on this project's VM).
        The caller's loop never blocks on the lock: while the router's loop holds it (a
        decision, a poll being replayed), the request hops to that loop as before.
        """
        loop = self._home_loop
        if loop is None or loop.is_closed():
            return None
        if loop is asyncio.get_running_loop():
            await self._before_decision()
            return self._decide_direct(request, replica_id)
        if (self._first_poll is not None and self._first_poll.is_set()
                and self._state_lock.acquire(blocking=False)):
            try:
                loop.call_soon_threadsafe(self.follower.hurry)   # this request's events follow
                return self._decide_direct(request, replica_id)
            finally:
                self._state_lock.release()
        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self.route_direct(request, replica_id), loop))

    def _decide_direct(self, request: GenerateRequest,
                       replica_id: str | None) -> tuple[str, list] | None:
        with self._state_lock:
            live = [r for r in list(self.curr_replicas.values())
                    if (r.routing_stats or {}).get("direct")]
            if replica_id is not None:
                live = [r for r in live if r.replica_id.unique_id == replica_id]
            if not live:
                return None
            ranks = [live] if replica_id is not None else self._rank(live, request,
                                                                     request.request_id)
            # Serve sends to the least loaded replica of the first rank with room; a direct
            # stream is not refused by a full replica, so the first rank's least loaded takes it.
            top = min(ranks[0], key=lambda r: self._in_flight(r) or 0)
            uid = top.replica_id.unique_id
            self._book(uid, request, request.request_id)
            self._direct[uid] = self._direct.get(uid, 0) + 1
            return uid, list(top.routing_stats["direct"])

    def direct_done(self, uid: str) -> None:
        """From any thread: a direct stream to ``uid`` ended."""
        loop = self._home_loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._direct_ended, uid)

    def _direct_ended(self, uid: str) -> None:
        with self._state_lock:
            left = self._direct.get(uid, 0) - 1
            if left > 0:
                self._direct[uid] = left
            else:
                self._direct.pop(uid, None)

    # ---- helpers -------------------------------------------------------------------------
    def _matches(self, request: GenerateRequest | None) -> tuple[str, str | None, dict]:
        """(mode, reason, matches): the index when live, else history, else nothing."""
        if request is None or not request.block_hashes:
            return "pow2", "no_hashes", {}
        reason = self.follower.status()
        if reason is None:
            return "kv_index", None, self.follower.index.match(request.block_hashes, touch=False)
        if self.history.empty():
            return "pow2", "no_history", {}
        return "approx", reason, self.history.index.match(request.block_hashes, touch=False)

    def _candidates(self, replicas: list[RunningReplica], matches: dict,
                    request: GenerateRequest | None, holder: str | None) -> list[Candidate]:
        """Each replica as the policy sees it (one pass: this is the decision's hot loop)."""
        hashes = request.block_hashes if request is not None else None
        active, now = self.active, time.time()
        out = []
        for replica in replicas:
            uid = replica.replica_id.unique_id
            match = indexed = matches.get(uid)
            if hashes:
                match = with_active(indexed, active, uid, hashes)
            out.append(Candidate(uid, match, replica.routing_stats or NO_STATS,
                                 self._in_flight(replica, now), active.count(uid),
                                 uid == holder, match is not indexed))
        return out

    def _session_holder(self, request: GenerateRequest | None,
                        replicas: list[RunningReplica]) -> str | None:
        """The candidate holding ``request``'s session: this router's last choice for it if
        still a candidate, else one whose reported stats list it; None if none does."""
        if request is None or not request.session_id:
            return None
        key = session_key(request.tenant, request.session_id)
        live = {r.replica_id.unique_id: r for r in replicas}
        mine = self._sessions.get(key)
        if mine in live:
            return mine
        for uid, replica in live.items():
            if key in self._reported_sessions(uid, replica.routing_stats or {}):
                return uid
        return None

    def _reported_sessions(self, uid: str, stats: dict) -> frozenset:
        """The session keys in a replica's stats, as a set rebuilt only when the stats change."""
        listed = stats.get("sessions") or []
        cached = self._stats_sessions.get(uid)
        if cached is None or cached[0] is not listed:
            cached = self._stats_sessions[uid] = (listed, frozenset(listed))
        return cached[1]

    def _note_active(self, key: str | None, request: GenerateRequest, ranked,
                     block_size: int, mode: str) -> None:
        """Blocks the top choice will compute count as active there until events confirm
        (moved by ``on_request_routed`` if Serve sends the request elsewhere)."""
        if not ranked or mode == "pow2":
            return
        top = ranked[0]
        new = request.block_hashes[top.predicted_cached_tokens // block_size:]
        self.active.add(top.replica_id, new)
        self._guesses[key] = (top.replica_id, new)
        while len(self._guesses) > 4096:                 # requests that were never routed
            self._guesses.popitem(last=False)

    def _confirmed(self, replica: str, hashes) -> None:
        self.active.confirm(replica, hashes)

    def _ensure_following(self) -> None:
        """Start the event-log follower on this router's event loop (once)."""
        self._home_loop = asyncio.get_running_loop()
        if self._follow_task is None or self._follow_task.done():
            self._first_poll = asyncio.Event()
            self._follow_task = start_background(self._follow())

    async def _await_first_poll(self) -> None:
        """Before this router's first decision, wait (at most ``FIRST_POLL_WAIT_S``, once per
        router) for the follower's first poll, so a router that just started routes by the index
        instead of by power of two; a directory that does not answer only costs that wait."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_poll.wait(), FIRST_POLL_WAIT_S)
        self._first_poll.set()

    async def _follow(self) -> None:
        await self.follower.run(after_poll=self._polled)

    def _polled(self) -> None:
        self._first_poll.set()
        self.metrics.router_index_lag(min(self.follower.lag_s(), 1e6))

    def _forget(self, uid: str) -> None:
        with self._state_lock:
            self._stats_sessions.pop(uid, None)
            self._direct.pop(uid, None)
            self._sent.pop(uid, None)
            self.follower.forget_replica(uid)
            self.history.forget(uid)
            self.active.forget(uid)
        loop = getattr(self, "_lazily_fetched_loop", None)    # Serve's router loop, if known
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return                    # no loop yet: the replica's next resync fixes it
        loop.call_soon_threadsafe(lambda: start_background(self._remove_from_directory(uid), loop))

    async def _remove_from_directory(self, uid: str) -> None:
        """Tell every shard the replica is gone (idempotent; failures only cost memory)."""
        for shard in self.shards:
            try:
                await shard.call("remove_replica", uid)
            except Exception as exc:  # noqa: BLE001 - a replica resync or restart fixes it
                logger.info("could not remove replica %s from the directory: %r", uid, exc)

    def _in_flight(self, replica: RunningReplica, now: float | None = None) -> int | None:
        """Requests at the replica: Serve's count of ongoing requests, but never more than its
        fresh routing stats allow (what it held when it reported, plus what this router sent
        it since); None when neither is known.

        Serve's count is kept by this router (plus one per send, minus one when a request
        ends, corrected when the replica accepts a request); streams cancelled by their
        clients can leave it high until it expires (10 s), and an idle replica that holds a
        prefix then loses every request to one that does not. The stats bound alone would
        count requests that ended since the report. ``now``: ``time.time()``.
        """
        cache = getattr(self, "_replica_queue_len_cache", None)
        serve = cache.get(replica.replica_id) if cache is not None else None
        uid = replica.replica_id.unique_id
        if serve is not None:                 # Serve does not see the direct streams
            serve += self._direct.get(uid, 0)
        stats = replica.routing_stats
        at = stats.get("at") if stats else None
        if not at or (time.time() if now is None else now) - at > STATS_FRESH_S:
            return serve
        sent = self._sent.get(uid, ())                                    # send times, in order
        bound = (int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
                 + len(sent) - bisect.bisect_right(sent, at))
        return bound if serve is None else min(serve, bound)

    def _route_request(self, request: GenerateRequest | None,
                       candidates: Sequence[Candidate]) -> RouteRequest:
        block_size = self.default_block_size
        for c in candidates:
            if c.stats.get("block_size"):
                block_size = int(c.stats["block_size"])
                break
        if request is None:
            return RouteRequest(prompt_tokens=0, block_size=block_size)
        key = session_key(request.tenant, request.prompt_cache_key) if request.prompt_cache_key else None
        return RouteRequest(len(request.prompt_token_ids), block_size, request.pinned,
                            request.priority, request.qos, request.session_id, key)

    def _kv_ranks(self, ranked, replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
        ordered = self._by_ids(ranked, replicas)
        k = self.num_single_ranks
        ranks = [[r] for r in ordered[:k]]
        if ordered[k:]:
            ranks.append(ordered[k:])
        return ranks

    @staticmethod
    def _by_ids(ranked, replicas: list[RunningReplica]) -> list[RunningReplica]:
        by_id = {r.replica_id.unique_id: r for r in replicas}
        return [by_id[x.replica_id] for x in ranked]

    @staticmethod
    def _record(request: GenerateRequest, ranked, mode: str, reason: str | None,
                start: float, start_cpu: float) -> None:
        md = request.metadata
        md["router_policy"] = POLICY_LABEL[mode]
        md["router_fallback_reason"] = reason
        md["router_predicted_cached_tokens"] = ranked[0].predicted_cached_tokens if ranked else 0
        md["router_predicted_by_replica"] = {x.replica_id: x.predicted_cached_tokens
                                             for x in ranked if x.predicted_cached_tokens}
        md["router_session_affinity"] = bool(ranked and ranked[0].session)
        md["router_cache_key_affinity"] = bool(ranked and ranked[0].cache_key)
        md["router_decision_ms"] = (time.perf_counter() - start) * 1000.0
        md["router_decision_cpu_ms"] = (time.thread_time() - start_cpu) * 1000.0


def _without_excluded(request: GenerateRequest | None,
                      replicas: list[RunningReplica]) -> list[RunningReplica]:
    """``replicas`` minus those the request must avoid (a failed earlier attempt), unless
    that would leave none."""
    excluded = request.metadata.get("exclude_replicas") if request is not None else None
    if not excluded:
        return replicas
    kept = [r for r in replicas if r.replica_id.unique_id not in excluded]
    return kept or replicas


class RoundRobinRouter(RequestRouter):
    """Round robin over the candidates (a comparison baseline for ``benchmarks/routing.py``)."""

    def initialize_state(self, **unused: Any) -> None:
        self._next = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = getattr(self, "_next", 0) % len(ordered)
        self._next = i + 1
        return [[ordered[i]], ordered[i + 1:] + ordered[:i]]
