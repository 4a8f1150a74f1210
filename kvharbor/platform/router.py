"""KVAwareRouter: Ray Serve request router that sends a prompt where its prefix is cached.

Set on the LLMReplica deployment::

    request_router_config=RequestRouterConfig(
        request_router_class="kvharbor.platform.router:KVAwareRouter",
        request_router_kwargs={"directory_name": "kvharbor-prefix-directory",
                               "directory_namespace": "kvharbor"},
        request_routing_stats_period_s=1.0)

One routing attempt (``choose_replicas``)::

    GenerateRequest (args[0] or kwargs["request"])
        │ block_hashes ──await directory.match (≤ match_timeout_s)──▶ {replica: MatchInfo}
        │ each candidate: routing_stats (lags) + Serve's in-flight count (fresh)
        ▼
    KVAwarePolicy.rank ──▶ [[best], [second], [all the rest]]
                            (Serve tries each rank in turn; a full replica is skipped)

Fallback to power-of-two choices when the request has no hashes, the directory is not
found yet, fails, or answers too late. The event loop is never blocked: the directory
lookup runs in a thread, ``match`` is awaited with a timeout.

The decision is written into ``request.metadata`` before the request is sent, so the
replica can compare predicted and observed prefix hits:

    router_policy                   "kv_aware" or "pow2_fallback"
    router_fallback_reason          why it fell back ("no_hashes", "directory_timeout", ...)
    router_decision_ms              time spent in choose_replicas (float ms)
    router_predicted_cached_tokens  cached tokens predicted on the top-ranked replica
    router_predicted_by_replica     {replica unique_id: predicted cached tokens} (hits only)
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvharbor.actors.prefix_directory import DEFAULT_DIRECTORY_NAME, MatchInfo
from kvharbor.platform.protocol import GenerateRequest
from kvharbor.platform.routing_policy import (Candidate, KVAwarePolicy, PowerOfTwoPolicy,
                                              RouteRequest, RoutingPolicy)

logger = logging.getLogger(__name__)


class DirectoryUnavailable(Exception):
    """The directory could not answer in time; ``reason`` names why (a metric label)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DirectoryClient:
    """Non-blocking access to the named PrefixDirectory actor.

    The handle is looked up by name in a worker thread (``ray.get_actor`` talks to the GCS
    synchronously); a failed lookup or a dead actor is retried after ``retry_s``. Lookup and
    ``match`` together take at most ``timeout_s``.
    """

    def __init__(self, name: str, namespace: str | None, timeout_s: float, retry_s: float,
                 handle: Any = None) -> None:
        self.name, self.namespace = name, namespace
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self._handle = handle
        self._lookup: asyncio.Future | None = None
        self._retry_at = 0.0

    async def match(self, block_hashes: Sequence) -> dict[str, MatchInfo]:
        """``PrefixDirectory.match`` or DirectoryUnavailable; never blocks the loop."""
        deadline = time.monotonic() + self.timeout_s
        handle = self._handle or await self._look_up(deadline)
        try:
            return await asyncio.wait_for(handle.match.remote(list(block_hashes)),
                                          max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise DirectoryUnavailable("directory_timeout") from None
        except Exception as exc:  # noqa: BLE001 - any failure means "route without it"
            logger.warning("prefix directory match failed (%s); routing without it", exc)
            if isinstance(exc, RayActorError):       # dead: look it up again later
                self._handle, self._retry_at = None, time.monotonic() + self.retry_s
            raise DirectoryUnavailable("directory_error") from None

    def forget(self, replica_id: str) -> None:
        """Fire-and-forget ``remove_replica`` (no-op while the handle is unknown)."""
        if self._handle is not None:
            try:
                self._handle.remove_replica.remote(replica_id)
            except Exception as exc:  # noqa: BLE001 - best effort; a resync fixes it later
                logger.info("could not tell the directory that %s died: %s", replica_id, exc)

    async def _look_up(self, deadline: float):
        if self._lookup is None:
            if time.monotonic() < self._retry_at:
                raise DirectoryUnavailable("directory_not_found")
            loop = asyncio.get_running_loop()
            self._lookup = loop.run_in_executor(None, self._get_actor)
            self._lookup.add_done_callback(_retrieve_exception)
        lookup = self._lookup
        try:
            self._handle = await asyncio.wait_for(asyncio.shield(lookup),
                                                  max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise DirectoryUnavailable("directory_lookup_pending") from None
        except Exception as exc:  # noqa: BLE001 - not created yet, GCS hiccup, ...
            logger.info("prefix directory %r not available (%s); retry in %.0f s",
                        self.name, exc, self.retry_s)
            self._retry_at = time.monotonic() + self.retry_s
            raise DirectoryUnavailable("directory_not_found") from None
        finally:
            if lookup.done() and self._lookup is lookup:
                self._lookup = None
        return self._handle

    async def remove_replicas(self, replica_ids: set[str]) -> None:
        """Tell the directory these replicas are gone (idempotent; failures are logged)."""
        try:
            handle = self._handle or await self._look_up(time.monotonic() + 10.0)
            await asyncio.gather(*(handle.remove_replica.remote(r) for r in replica_ids))
        except Exception as exc:  # noqa: BLE001 - stale entries only cost memory
            logger.warning("could not remove replicas %s from the prefix directory: %r",
                           sorted(replica_ids), exc)

    def _get_actor(self):
        import ray

        return ray.get_actor(self.name, namespace=self.namespace)


def _retrieve_exception(fut: asyncio.Future) -> None:
    """Mark a background lookup's exception as seen (it is handled by the next caller)."""
    if not fut.cancelled():
        fut.exception()


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


class KVAwareRouter(RequestRouter):
    """Prefix-cache-aware, load-balanced routing for ``LLMReplica`` (see module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initialize_state()

    def initialize_state(self, directory_name: str = DEFAULT_DIRECTORY_NAME,
                         directory_namespace: str | None = None, match_timeout_s: float = 0.05,
                         lookup_retry_s: float = 5.0, num_single_ranks: int = 2,
                         default_block_size: int = 16, policy: dict | None = None,
                         **unknown: Any) -> None:
        """Configure from ``request_router_kwargs`` (every argument is JSON-serializable).

        Args:
            directory_name / directory_namespace: the named PrefixDirectory actor.
            match_timeout_s: longest wait for the directory before falling back.
            lookup_retry_s: how long to wait before looking the directory up again.
            num_single_ranks: how many best replicas get a rank of their own before the
                rest share the last rank (Serve picks the least queued in a shared rank).
            default_block_size: used when a replica has not reported ``block_size`` yet.
            policy: keyword arguments for ``KVAwarePolicy`` (e.g. ``load_cost_tokens``).
        """
        if unknown:
            raise ValueError(f"unknown KVAwareRouter kwargs {sorted(unknown)}; see "
                             "KVAwareRouter.initialize_state for the accepted names")
        if num_single_ranks < 1 or match_timeout_s <= 0 or default_block_size < 1:
            raise ValueError("num_single_ranks and default_block_size must be >= 1 and "
                             "match_timeout_s > 0")
        self.directory = DirectoryClient(directory_name, directory_namespace, match_timeout_s,
                                         lookup_retry_s)
        self.policy: RoutingPolicy = KVAwarePolicy(**(policy or {}))
        self.fallback = PowerOfTwoPolicy(random.Random())
        self.num_single_ranks = num_single_ranks
        self.default_block_size = default_block_size

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set; replicas that left it are removed from the directory.

        Serve's controller is the authority on which replicas are alive (it restarts a dead
        one under a new id), and every router gets its updates, so a dead replica's blocks
        stop being matched even if no request ever reaches it again.
        """
        gone = ({r.unique_id for r in self.curr_replicas}
                - {r.replica_id.unique_id for r in replicas})
        super().update_replicas(replicas)
        if gone:
            self._event_loop.create_task(self.directory.remove_replicas(gone))

    def on_replica_actor_died(self, replica_id) -> None:
        """A request found the replica dead before Serve's next update: forget it now."""
        super().on_replica_actor_died(replica_id)
        self._event_loop.create_task(self.directory.remove_replicas({replica_id.unique_id}))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """Rank ``candidate_replicas`` for ``pending_request`` (one routing attempt)."""
        if not candidate_replicas:
            return []
        target = pinned_replica(pending_request, candidate_replicas)
        if target is not None:
            return [[target]]
        start = time.perf_counter()
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # sleep between attempts
        request = generate_request_of(pending_request)
        matches, reason = {}, None
        if request is None or not request.block_hashes:
            reason = "no_hashes"
        else:
            try:
                matches = await self.directory.match(request.block_hashes)
            except DirectoryUnavailable as exc:
                reason = exc.reason
        candidates = [self._candidate(r, matches) for r in candidate_replicas]
        route = self._route_request(request, candidates)
        if reason is None:
            ranked = self.policy.rank(route, candidates)
            ranks = self._kv_ranks(ranked, candidate_replicas)
        else:
            ranked = self.fallback.rank(route, candidates)
            ranks = [self._by_ids(ranked[:2], candidate_replicas)]
        if request is not None:
            self._record(request, ranked, reason, start)
        return ranks

    def on_replica_actor_died(self, replica_id) -> None:
        """Serve saw the replica die: drop it here and from the directory."""
        super().on_replica_actor_died(replica_id)
        self.directory.forget(replica_id.unique_id)

    # ---- helpers -------------------------------------------------------------------------
    def _candidate(self, replica: RunningReplica, matches: dict) -> Candidate:
        uid = replica.replica_id.unique_id
        return Candidate(uid, matches.get(uid), replica.routing_stats or {},
                         self._in_flight(replica))

    def _in_flight(self, replica: RunningReplica) -> int | None:
        """Serve's fresh count of ongoing requests at the replica (None when unknown)."""
        cache = getattr(self, "_replica_queue_len_cache", None)
        return cache.get(replica.replica_id) if cache is not None else None

    def _route_request(self, request: GenerateRequest | None,
                       candidates: Sequence[Candidate]) -> RouteRequest:
        block_size = next((int(c.stats["block_size"]) for c in candidates
                           if c.stats.get("block_size")), self.default_block_size)
        if request is None:
            return RouteRequest(prompt_tokens=0, block_size=block_size)
        return RouteRequest(len(request.prompt_token_ids), block_size, request.pinned,
                            request.priority, request.qos)

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
    def _record(request: GenerateRequest, ranked, reason: str | None, start: float) -> None:
        md = request.metadata
        md["router_policy"] = "kv_aware" if reason is None else "pow2_fallback"
        md["router_fallback_reason"] = reason
        md["router_predicted_cached_tokens"] = ranked[0].predicted_cached_tokens if ranked else 0
        md["router_predicted_by_replica"] = {x.replica_id: x.predicted_cached_tokens
                                             for x in ranked if x.predicted_cached_tokens}
        md["router_decision_ms"] = (time.perf_counter() - start) * 1000.0


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
