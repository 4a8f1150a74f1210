"""What a router knows before the KV events arrive: blocks it just sent, and its own history.

``ActiveBlocks`` (NVIDIA Dynamo's "active blocks"): the block hashes this router sent to
each replica that no stored event has confirmed yet. They count twice in a decision:
  * as a predicted hit: a second request with the same new prefix, routed before the
    first one's events arrive, is expected to find the prefix where the first one went;
  * as load: blocks the replica still has to compute, so a burst of one new prefix does
    not all pile onto one replica before any routing stats move.
An entry leaves when a stored event confirms it or after ``ttl_s`` (the request failed,
was preempted, or its blocks were evicted before anyone saw them).

``RoutingHistory`` (SGLang's approximate router): the prompts this router sent to each
replica, as if each replica cached everything it was sent, bounded in blocks with LRU
eviction. Used only while the event stream is not live.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import repeat

from kvharbor.actors.prefix_directory import MatchInfo, PrefixIndex
from kvharbor.engine.hashing import BlockHash


class ActiveBlocks:
    """Per replica: unconfirmed block hashes in send order, each with its expiry time.

    Invariant: every replica's map is ordered by expiry (all entries share one ttl, and a
    re-sent hash moves to the end), so expiring pops from the front only.
    """

    def __init__(self, ttl_s: float = 5.0, max_per_replica: int = 65_536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_per_replica, self.clock = ttl_s, max_per_replica, clock
        self._pending: dict[str, OrderedDict[BlockHash, float]] = {}

    def add(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        """``hashes`` were just sent to ``replica`` (not cached there as far as we know)."""
        if not hashes:
            return
        mine = self._pending.setdefault(replica, OrderedDict())
        for h in mine.keys() & hashes:       # re-sent: moves to the end with the new expiry
            del mine[h]
        mine.update(zip(hashes, repeat(self.clock() + self.ttl_s)))   # one C-level loop
        while len(mine) > self.max_per_replica:
            mine.popitem(last=False)

    def discard(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        """Take back a tentative add (the request went elsewhere) or confirm (events came)."""
        mine = self._pending.get(replica)
        if mine:
            for h in hashes:
                mine.pop(h, None)

    confirm = discard

    def forget(self, replica: str) -> None:
        self._pending.pop(replica, None)

    def count(self, replica: str) -> int:
        """Unconfirmed blocks at ``replica`` (expired entries dropped first)."""
        mine = self._pending.get(replica)
        if not mine:
            return 0
        now = self.clock()
        while mine and next(iter(mine.values())) <= now:
            mine.popitem(last=False)
        return len(mine)

    def extend(self, replica: str, hashes: Sequence[BlockHash], start: int) -> int:
        """How many blocks from ``hashes[start]`` on are pending at ``replica`` in a row."""
        mine = self._pending.get(replica)
        if not mine:
            return 0
        n = start
        while n < len(hashes) and hashes[n] in mine:
            n += 1
        return n - start

    def replicas(self) -> list[str]:
        return [r for r in self._pending if self.count(r)]


def with_active(match: MatchInfo | None, active: ActiveBlocks, replica: str,
                hashes: Sequence[BlockHash]) -> MatchInfo | None:
    """``match`` extended by the blocks pending at ``replica`` right after it."""
    start = match.blocks if match is not None else 0
    more = active.extend(replica, hashes, start)
    if not more:
        return match
    if match is None:
        return MatchInfo(more, more, 0)
    return MatchInfo(match.blocks + more, match.device_blocks + more, match.host_blocks)


class RoutingHistory:
    """Approximate per-replica cache contents from routing decisions alone (LRU-bounded)."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.index = PrefixIndex(max_blocks)
        self._seq: dict[str, int] = {}

    def record(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        """``replica`` was sent a prompt with these block hashes."""
        if not hashes:
            return
        seq = self._seq.get(replica, 0)
        self.index.apply_batch(replica, seq, hashes, closed=True)   # whole chains from the root
        self._seq[replica] = seq + 1

    def forget(self, replica: str) -> None:
        self.index.remove_replica(replica)
        self._seq.pop(replica, None)

    def empty(self) -> bool:
        return self.index.stats()["num_entries"] == 0
