"""Routing policies: pure strategy objects that rank candidate replicas for one request.

No Ray and no I/O here: the router (``kvharbor.platform.router``) gathers the inputs (prefix
matches from the directory, each replica's routing stats and in-flight count) and a policy
returns the candidates best first. The simulator in ``benchmarks/routing_sim.py`` runs the
same objects.

``KVAwarePolicy`` scores, in prompt tokens::

    score = cached tokens (device hits + host_hit_weight * host hits)
          - load_cost_tokens * requests ahead (running + waiting of equal or higher priority,
            less one computing this prompt's prefix there: see below)
          - block_size * blocks the request needs but the replica has no free block for
          - pinned_miss_cost * block_size * blocks a pinned request can't get from the region
          - active_token_cost * block_size * blocks sent there and not yet confirmed cached
          - evict_cost * block_size * blocks the request needs x the share of the replica's
            shared region holding cached prefixes (at least those needed beyond its empty
            blocks): the cache it displaces now or soon

and ranks replicas that are *overloaded* (in-flight above ``(1 + imbalance_tolerance)``
times the mean and more than ``balance_slack`` above the least loaded) after all others,
least loaded first: a hot prefix spills to other replicas instead of piling onto one.
The eviction term is what spreads new prefixes over the fleet. Free blocks include cached
(evictable) ones, so without it a replica full of other tenants' prefixes looks as roomy as an
empty one, and a prompt that shares one leading block (a chat template) with what a busy
replica holds scores above an empty replica, every time: on a 4-replica run
(``benchmarks/routing.py --seed 5``) two replicas got no request and their caches stayed
empty while the other two evicted each other's tenants. Charging only the blocks needed
beyond the empty ones fixed that but filled replicas one after the other (``--seed 6``:
54/51/33/6 requests); charging by occupancy fills them evenly, as Ray's router does by
sending a prefix it has not seen to the replica with the smallest tree.
A request ahead that computes this prompt's prefix is not a queue to wait in but the hit
on its way: when a candidate's match reaches blocks this router sent there and no KV event
has confirmed (``Candidate.pending_hit``), one request fewer counts ahead. Before, the
second copy of a burst of one ~400-token prefix scored 400 saved - 512 for the copy ahead
- 100 for its pending blocks, below an idle replica that held nothing, so a burst sent
through one gateway split after its first request and recomputed the prefix elsewhere
(``benchmarks/cache_key.py``); the third copy still sees one request ahead and may spill.
Session affinity: a request with a session id goes first to the replica holding that
session (``Candidate.holds_session``) unless that replica is overloaded (the same guard);
when no candidate holds it (the replica is gone), the score decides as for any request.
Cache-key affinity (OpenAI's ``prompt_cache_key``, the client's word that its requests with
one key share long prefixes): the key's home is the replica with the highest rendezvous
weight (``key_weight``) among those not overloaded, the same replica in every router that
sees the same replicas, with no state shared between them; it goes first unless another
replica not overloaded already holds more of the prompt (then the score decides). A hot key
spills to its next home when the load guard marks its home overloaded, and a replica
leaving moves only the keys it was home to.
Equal scores go to the less loaded replica, then to the one this policy ranked first least
recently (so identical idle replicas take turns).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from kvharbor.actors.prefix_directory import MatchInfo

NO_STATS: Mapping = MappingProxyType({})     # the stats of a replica that has not reported yet


# The value types below are built several times per routing decision, on its measured path:
# immutable NamedTuples, which build about five times faster than frozen slots dataclasses.
class RouteRequest(NamedTuple):
    """What a policy knows about the request being routed."""

    prompt_tokens: int
    block_size: int
    pinned: bool = False
    priority: int = 0           # higher is more important
    qos: str | None = None
    session_id: str | None = None   # set: candidates holding this session rank first (affinity)
    cache_key: str | None = None    # tenant-scoped prompt_cache_key: its home ranks first (affinity)


class Candidate(NamedTuple):
    """One replica as the policy sees it.

    ``stats`` is the dict the replica last returned from ``record_routing_stats`` (keys of
    ``kvharbor.platform.protocol.RoutingStats``; may be empty before its first report).
    ``in_flight`` is the router's fresher count of requests at the replica, if it has one.
    ``active_blocks`` counts blocks this router sent there that no KV event confirmed yet
    (prefill work the replica still has ahead of it).
    """

    replica_id: str
    match: MatchInfo | None = None
    stats: Mapping = NO_STATS
    in_flight: int | None = None
    active_blocks: int = 0
    holds_session: bool = False     # the replica holds the request's session (its turns' KV)
    pending_hit: bool = False       # the match reaches blocks this router sent there, unconfirmed


class Ranked(NamedTuple):
    """A candidate with its score; ``predicted_cached_tokens`` counts device and host hits."""

    replica_id: str
    score: float
    predicted_cached_tokens: int
    load: int
    overloaded: bool = False
    session: bool = False           # ranked first for session affinity
    cache_key: bool = False         # ranked first as the home of the request's cache key


class RoutingPolicy(Protocol):
    """Ranks candidates best first; every candidate appears exactly once."""

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Ranked]: ...


def replica_load(c: Candidate) -> int:
    """Requests at the replica: the router's in-flight count, else running + waiting."""
    if c.in_flight is not None:
        return c.in_flight
    return int(c.stats.get("num_running", 0)) + int(c.stats.get("num_waiting", 0))


def displaced_blocks(stats: Mapping, needed: int) -> float:
    """Cached blocks that ``needed`` new blocks displace at the replica, now or soon: the
    blocks beyond its empty ones, or ``needed`` x the occupied share of its shared region if
    more (0 for a replica that does not report its empty blocks)."""
    empty, region = stats.get("empty_shared_blocks"), stats.get("shared_blocks")
    if empty is None or needed <= 0:
        return 0.0
    now = max(0, needed - int(empty))
    if not region:
        return float(now)
    return max(float(now), needed * (1.0 - min(int(empty), int(region)) / int(region)))


def key_weight(cache_key: str, replica_id: str) -> int:
    """Rendezvous (highest random weight) hash of a cache key on a replica: the same number in
    every process (not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{cache_key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def cached_tokens(request: RouteRequest, match: MatchInfo | None) -> int:
    """Prompt tokens the replica holds (device + host), never more than the prompt."""
    if match is None:
        return 0
    return min(match.blocks * request.block_size, request.prompt_tokens)


@dataclass(slots=True)
class KVAwarePolicy:
    """Prefix-hit score minus load penalty, with a hard balance guard (see module doc)."""

    host_hit_weight: float = 0.5        # a host hit saves compute but costs a copy
    load_cost_tokens: float = 512.0     # tokens-equivalent per request ahead in the queue
    imbalance_tolerance: float = 0.15   # overloaded above (1 + this) * mean load ...
    balance_slack: int = 2              # ... and more than this many above the least loaded
    pinned_miss_cost: float = 0.25      # per block (x block_size) a pinned request can't pin
    active_token_cost: float = 0.25     # per token of prefill sent there, not yet confirmed
    evict_cost: float = 0.25            # per block (x block_size) displacing cached prefixes
    _turn: int = field(default=0, init=False, repr=False)
    _first_at: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Ranked]:
        """Candidates best first: balanced ones by score, then overloaded ones by load."""
        if not candidates:
            return []
        loads = [replica_load(c) for c in candidates]
        limit = sum(loads) / len(loads) * (1 + self.imbalance_tolerance)
        slack = min(loads) + self.balance_slack
        session, score = bool(request.session_id), self.score
        ranked = []
        for c, load in zip(candidates, loads):
            over = load > limit and load > slack
            ranked.append(Ranked(c.replica_id, score(request, c, load),
                                 cached_tokens(request, c.match), load, over,
                                 session and c.holds_session and not over))
        if request.cache_key:                   # a session holder still ranks first
            ranked = _with_key_home(request.cache_key, ranked)
        ranked.sort(key=lambda r: (r.overloaded, not r.session, not r.cache_key,
                                   r.load if r.overloaded else -r.score,
                                   r.load, self._first_at.get(r.replica_id, -1)))
        self._turn += 1
        self._first_at[ranked[0].replica_id] = self._turn
        if len(self._first_at) > 4 * len(candidates) + 64:     # forget departed replicas
            live = {c.replica_id for c in candidates}
            self._first_at = {k: v for k, v in self._first_at.items() if k in live}
        return ranked

    def score(self, request: RouteRequest, c: Candidate, load: int) -> float:
        """Tokens not recomputed minus load and memory penalties (higher is better)."""
        bs = request.block_size
        m = c.match
        saved = 0.0
        if m is not None:
            saved = bs * (m.device_blocks + self.host_hit_weight * m.host_blocks)
            saved = min(saved, float(request.prompt_tokens))
        penalty = self.load_cost_tokens * self._requests_ahead(request, c, load)
        penalty += self.active_token_cost * bs * c.active_blocks
        needed = -(-request.prompt_tokens // bs) - (m.device_blocks if m else 0)  # host hits need device blocks too
        free_shared = c.stats.get("free_shared_blocks")
        free_pinned = int(c.stats.get("free_pinned_blocks", 0)) if request.pinned else 0
        if free_shared is not None:
            penalty += bs * max(0, needed - int(free_shared) - free_pinned)
        if request.pinned:
            penalty += self.pinned_miss_cost * bs * max(0, needed - free_pinned)
        else:
            penalty += self.evict_cost * bs * displaced_blocks(c.stats, needed)
        return saved - penalty

    def _requests_ahead(self, request: RouteRequest, c: Candidate, load: int) -> int:
        """``load`` minus requests of lower priority (the replica schedules them after), and
        minus one when a request ahead is computing this prompt's prefix (``pending_hit``).

        Replicas report ``queue_by_priority`` with the priority each request carries, so a
        tenants.yaml reload that changes a class's priority needs nothing from the router.
        """
        ahead = load - int(c.pending_hit)
        queue = c.stats.get("queue_by_priority")
        if queue:
            ahead -= sum(n for priority, n in queue.items() if int(priority) < request.priority)
        return max(0, ahead)


def _with_key_home(cache_key: str, ranked: list[Ranked]) -> list[Ranked]:
    """``ranked`` with the key's home marked (see the module doc), if it holds at least as
    much of the prompt as any other replica not overloaded."""
    balanced = [r for r in ranked if not r.overloaded]
    if not balanced:
        return ranked
    home = max(balanced, key=lambda r: key_weight(cache_key, r.replica_id))
    if home.predicted_cached_tokens < max(r.predicted_cached_tokens for r in balanced):
        return ranked
    return [r._replace(cache_key=True) if r is home else r for r in ranked]


@dataclass(slots=True)
class PowerOfTwoPolicy:
    """Two random candidates, the less loaded first; the rest follow in random order."""

    rng: random.Random = field(default_factory=random.Random)

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Ranked]:
        order = list(candidates)
        self.rng.shuffle(order)
        order[:2] = sorted(order[:2], key=replica_load)
        return [Ranked(c.replica_id, 0.0, cached_tokens(request, c.match), replica_load(c))
                for c in order]


@dataclass(slots=True)
class RoundRobinPolicy:
    """Candidates in turn, ignoring cache and load (a baseline)."""

    next_index: int = 0

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Ranked]:
        if not candidates:
            return []
        start = self.next_index % len(candidates)
        self.next_index += 1
        order = list(candidates[start:]) + list(candidates[:start])
        return [Ranked(c.replica_id, 0.0, cached_tokens(request, c.match), replica_load(c))
                for c in order]
