"""The prefix directory: which replica holds which full KV block.

``PrefixIndex`` is a plain, thread-safe class (tested without Ray). ``DirectoryShard`` is a
``PrefixIndex`` plus the ``EventLog`` of every change applied to it; ``PrefixDirectory`` is
its thin ``@ray.remote`` wrapper, one named actor per shard (``shard_name``; one shard by
default). Each replica's engine sends its KV events (full-block hashes stored / removed,
with a per-replica sequence number) to its shard (``shard_of``); every router keeps its own
``PrefixIndex`` by replaying the shards' logs (``kvharbor.platform.index_follower``) and
asks its local ``match(block_hashes)`` how many *leading* blocks of a prompt each replica
already holds: no remote call per routing decision.

Memory (``benchmarks/routing_bound.bytes_per_entry``: deep getsizeof, CPython 3.11, 16-byte
hashes, the hash objects included): about 410 bytes per (hash, replica) entry when one
replica holds a hash, 210-260 with two, 180 with four, 140 with sixteen (the per-hash dict and
LRU node are shared by its holders). ``max_blocks`` bounds the entries, so an index takes at
most ~450 bytes x ``max_blocks`` (1.8 GB at the 4M default: set it near the fleet's total
KV blocks). A router's local index has the same bound (``max_index_blocks``).

After replica ``a`` stored ``[h0 h1 h2]``, replica ``b`` stored ``[h0 h1]`` and offloaded
``h1`` to host memory (stored with ``tier="host"``, removed from ``"device"``)::

    LRU order (oldest ... newest)     replicas holding it (tier bits)
    h0 ──────────────────────────▶   {a: D, b: D}
    h1 ──────────────────────────▶   {a: D, b: H}
    h2 ──────────────────────────▶   {a: D}

    match([h0, h1, h2, h9]) → {a: MatchInfo(3 blocks: 3 device, 0 host),
                                b: MatchInfo(2 blocks: 1 device, 1 host)}

Invariants (``check_integrity`` verifies them):
  * an entry (hash, replica) exists in ``_holders`` iff the hash is in that replica's set,
    and its tier mask is never 0;
  * ``num_entries`` == total (hash, replica) pairs <= ``max_blocks``; the least recently
    stored-or-matched hashes are forgotten first (all their replicas at once);
  * a replica's batches apply only in sequence order: ``seq_no`` must be the replica's next
    expected number (0 for a replica never seen). A gap marks the replica as needing a
    resync; until ``resync`` its batches are ignored (its last known view stays matchable);
  * a replica is *closed* only while its latest batch or resync said its cache is
    prefix-closed (``closed=True``: every cached block's parent cached too) and this index
    has forgotten none of its hashes to the bound since its last resync.

Matching a closed replica bisects: along a prompt's chain, the blocks it holds are then a
prefix, so finding where that prefix ends takes ~log2(n) lookups instead of one per leading
block (7 instead of ~110 for a 1,700-token prompt; a router's decision runs from cold CPU
caches, where each lookup is a few cache misses). Replicas not known to be closed are
matched block by block, as is any match while host-only entries exist.
"""

from __future__ import annotations

import threading
import zlib
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress, count, repeat
from operator import not_
from typing import NamedTuple, NewType

import ray

from kvharbor.actors.directory_log import EventLog
from kvharbor.engine.hashing import BlockHash

ReplicaId = NewType("ReplicaId", str)

TIERS: dict[str, int] = {"device": 1, "host": 2}
"""Tier name -> bit in an entry's tier mask. A block may sit in both tiers at once."""
_HOST_ONLY = TIERS["host"]

DEFAULT_MAX_BLOCKS = 4_000_000
DEFAULT_DIRECTORY_NAME = "kvharbor-prefix-directory"


class MatchInfo(NamedTuple):
    """Leading blocks of one prompt that one replica holds.

    ``blocks == device_blocks + host_blocks``; a block held in both tiers counts as device.
    A NamedTuple: matches are built per replica in every routing decision.
    """

    blocks: int
    device_blocks: int
    host_blocks: int


def _tier_bit(tier: str) -> int:
    try:
        return TIERS[tier]
    except KeyError:
        raise ValueError(f"unknown KV tier {tier!r}; use one of {sorted(TIERS)}") from None


class PrefixIndex:
    """Block hash -> replicas holding it, bounded, with in-order per-replica event batches.

    Every public method takes one lock, so one instance may be shared across threads.
    Costs: ``apply_events`` O(hashes in batch); ``match`` O(sum over leading blocks of the
    replicas still matching); eviction O(replicas holding the evicted hash).
    """

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        """Args:
            max_blocks: bound on (hash, replica) entries, i.e. on blocks tracked over all
                replicas together. Must be positive.
        """
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self._max_blocks = max_blocks
        self._lock = threading.Lock()
        # hash -> {replica: tier mask}; order = LRU (first = least recently stored/matched)
        self._holders: OrderedDict[BlockHash, dict[ReplicaId, int]] = OrderedDict()
        self._by_replica: dict[ReplicaId, set[BlockHash]] = {}
        self._next_seq: dict[ReplicaId, int] = {}
        self._resync_needed: set[ReplicaId] = set()
        self._closed: set[ReplicaId] = set()      # views known to be prefix-closed
        self._trimmed: set[ReplicaId] = set()     # lost hashes to the bound since a resync
        self._num_entries = 0
        self._host_only = 0              # entries whose mask is exactly _HOST_ONLY
        self._counters = {"batches_applied": 0, "batches_ignored": 0, "gaps": 0,
                          "resyncs": 0, "matches": 0, "bisected_matches": 0,
                          "evicted_entries": 0}

    # ---- events ------------------------------------------------------------------------
    def apply_events(self, replica_id: ReplicaId, seq_no: int, stored: Sequence[BlockHash] = (),
                     removed: Sequence[BlockHash] = (), tier: str = "device",
                     closed: bool | None = None) -> bool:
        """Apply one event batch of ``replica_id``: first ``stored``, then ``removed``.

        Args:
            replica_id: the replica that emitted the batch.
            seq_no: the batch's sequence number; 0 for a replica's first batch, then +1 each.
            stored: hashes that became cached in ``tier`` (in prompt order).
            removed: hashes that left ``tier``.
            tier: "device" or "host".
            closed: whether the replica's cache is prefix-closed after this batch; None
                leaves what the replica said before (a replica never heard from is not).
        Returns:
            True when the batch was applied (or is an already-applied duplicate, ignored).
            False on a gap, or while the replica awaits a resync: the caller should send
            ``resync`` with a full snapshot.
        """
        return self.apply_batch(replica_id, seq_no, stored, removed, tier, closed) in (
            "applied", "duplicate")

    def apply_batch(self, replica_id: ReplicaId, seq_no: int, stored: Sequence[BlockHash] = (),
                    removed: Sequence[BlockHash] = (), tier: str = "device",
                    closed: bool | None = None) -> str:
        """``apply_events`` with the outcome named: "applied", "duplicate" (an already
        applied ``seq_no``, ignored), "gap" (now awaiting a resync) or "awaiting_resync"."""
        bit = _tier_bit(tier)
        with self._lock:
            if replica_id in self._resync_needed:
                self._counters["batches_ignored"] += 1
                return "awaiting_resync"
            expected = self._next_seq.get(replica_id, 0)
            if seq_no < expected:
                self._counters["batches_ignored"] += 1
                return "duplicate"
            if seq_no > expected:
                self._counters["gaps"] += 1
                self._resync_needed.add(replica_id)
                return "gap"
            self._next_seq[replica_id] = seq_no + 1
            self._store(replica_id, stored, bit)
            for h in removed:
                self._unset(replica_id, h, bit)
            if closed is not None:
                self._set_closed(replica_id, closed)
            self._evict_overflow()
            self._counters["batches_applied"] += 1
            return "applied"

    def resync(self, replica_id: ReplicaId, seq_no: int,
               hashes_by_tier: Mapping[str, Iterable[BlockHash]], closed: bool = False) -> None:
        """Replace ``replica_id``'s view with a snapshot taken after its batch ``seq_no``.

        The next batch accepted from it is ``seq_no + 1`` (use -1 for "before any batch").
        ``closed``: whether the snapshot is prefix-closed (see the module doc).
        """
        bits = {tier: _tier_bit(tier) for tier in hashes_by_tier}
        with self._lock:
            self._drop_replica(replica_id)       # also clears its resync-needed and trimmed flags
            self._by_replica[replica_id] = set()
            for tier, hashes in hashes_by_tier.items():
                self._store(replica_id, hashes, bits[tier])
            self._next_seq[replica_id] = seq_no + 1
            self._set_closed(replica_id, closed)
            self._evict_overflow()
            self._counters["resyncs"] += 1

    def clear(self) -> None:
        """Forget every replica and reset the counters (e.g. after the whole app restarted)."""
        with self._lock:
            self._holders.clear()
            self._by_replica.clear()
            self._next_seq.clear()
            self._resync_needed.clear()
            self._closed.clear()
            self._trimmed.clear()
            self._num_entries = self._host_only = 0
            self._counters = dict.fromkeys(self._counters, 0)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        """Forget a replica (it died or scaled down); its sequence restarts at 0."""
        with self._lock:
            self._drop_replica(replica_id)

    # ---- queries -----------------------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash],
              touch: bool = True) -> dict[ReplicaId, MatchInfo]:
        """Leading blocks of ``block_hashes`` held by each replica (stop at its first miss).

        Only replicas holding at least the first block appear. With ``touch``, matched
        hashes become the most recently used (a router's local index passes False: its
        bound follows stores, and a read-only match is cheaper). Cost: one C-level set
        difference per leading block (a membership test while one replica matches), plus a
        Python loop over the still-matching replicas only while host-only entries exist.
        """
        with self._lock:
            self._counters["matches"] += 1
            if not touch and not self._host_only:
                fast = self._match_read_only(block_hashes)
                if fast is not None:
                    return fast
            ends: dict[ReplicaId, int] = {}          # replica -> leading blocks held
            host: dict[ReplicaId, int] = {}          # replica -> host-only blocks among them
            alive: set[ReplicaId] = set()
            n = 0
            for n, h in enumerate(block_hashes):
                holders = self._holders.get(h)
                if holders is None:
                    break
                if n == 0:
                    alive = set(holders)
                    single = next(iter(alive)) if len(alive) == 1 else None
                elif single is not None:
                    if single not in holders:
                        ends[single] = n
                        alive = set()
                        break
                else:
                    gone = alive.difference(holders)
                    if gone:
                        ends.update(dict.fromkeys(gone, n))
                        alive -= gone
                        if not alive:
                            break
                        single = next(iter(alive)) if len(alive) == 1 else None
                if touch:
                    self._holders.move_to_end(h)
                if self._host_only:
                    for r in alive:
                        if holders[r] == _HOST_ONLY:
                            host[r] = host.get(r, 0) + 1
            else:
                n = len(block_hashes)
            ends.update(dict.fromkeys(alive, n))
            return {r: MatchInfo(k, k - host.get(r, 0), host.get(r, 0))
                    for r, k in ends.items()}

    def _match_read_only(self, block_hashes: Sequence[BlockHash]) -> dict[ReplicaId, MatchInfo] | None:
        """``match`` without LRU touches or host-only entries (a router's common case).

        When every replica holding the first block is closed, each one's end is found by
        bisection (``_bisect_ends``). Otherwise in C-level loops: the holders of each leading
        block in one ``map``, then per replica holding the first block, the index of its
        first miss. None when many replicas share the first block: ``match``'s one pass over
        set differences is then cheaper than a pass per replica. Caller holds the lock."""
        if not block_hashes:
            return {}
        first = self._holders.get(block_hashes[0])
        if first is None:
            return {}
        if len(first) > 8:
            return None
        if self._closed.issuperset(first):
            self._counters["bisected_matches"] += 1
            return self._bisect_ends(block_hashes, first)
        held = list(map(self._holders.get, block_hashes))
        try:
            n = held.index(None)
        except ValueError:
            n = len(held)
        held = held[:n]
        out = {}
        for r in first:
            k = next(compress(count(), map(not_, map(dict.__contains__, held, repeat(r)))), n)
            out[r] = MatchInfo(k, k, 0)
        return out

    def _bisect_ends(self, block_hashes: Sequence[BlockHash],
                     first: dict[ReplicaId, int]) -> dict[ReplicaId, MatchInfo]:
        """Per replica in ``first`` (all closed), how many leading blocks it holds, by
        bisection: its holds are a prefix of the chain, so in the chain reversed they are a
        suffix, where ``bisect_left`` keyed by the replica's hash set finds their start in C
        (``log2(len)`` set lookups, no Python loop)::

            chain     h0 h1 h2 h3 h4        replica holds h0 h1 h2
            reversed  h4 h3 h2 h1 h0   key  F F T T T  -> bisect_left(.., True) = 2,  5 - 2 = 3

        Caller holds the lock."""
        reverse, n, out = block_hashes[::-1], len(block_hashes), {}
        for r in first:
            k = n - bisect_left(reverse, True, key=self._by_replica[r].__contains__)
            out[r] = MatchInfo(k, k, 0)
        return out

    def is_closed(self, replica_id: ReplicaId) -> bool:
        """Whether ``replica_id``'s view is known to be prefix-closed (matched by bisection)."""
        with self._lock:
            return replica_id in self._closed

    def closed_replicas(self) -> list[ReplicaId]:
        """Replicas whose views are known to be prefix-closed."""
        with self._lock:
            return sorted(self._closed)

    def replica_hashes(self, replica_id: ReplicaId) -> set[BlockHash]:
        """A copy of the hashes the directory believes ``replica_id`` holds (any tier)."""
        with self._lock:
            return set(self._by_replica.get(replica_id, ()))

    def needs_resync(self, replica_id: ReplicaId) -> bool:
        """Whether ``replica_id`` had a sequence gap and has not resynced since."""
        with self._lock:
            return replica_id in self._resync_needed

    def next_seq_no(self, replica_id: ReplicaId) -> int:
        """The sequence number the next batch of ``replica_id`` must carry."""
        with self._lock:
            return self._next_seq.get(replica_id, 0)

    def snapshot(self) -> dict[ReplicaId, tuple[int, dict[str, list[BlockHash]]]]:
        """Every tracked replica's view: ``{replica: (last applied seq_no, {tier: hashes})}``.

        ``resync(replica, *snapshot()[replica])`` on an empty index reproduces the view. A
        replica awaiting a resync is left out (its view is known to be incomplete).
        """
        with self._lock:
            out = {}
            for r, hashes in self._by_replica.items():
                if r in self._resync_needed:
                    continue
                tiers: dict[str, list[BlockHash]] = {name: [] for name in TIERS}
                for h in hashes:
                    mask = self._holders[h][r]
                    for name, bit in TIERS.items():
                        if mask & bit:
                            tiers[name].append(h)
                out[r] = (self._next_seq.get(r, 0) - 1, tiers)
            return out

    def replicas(self) -> list[ReplicaId]:
        """Replicas the directory currently tracks."""
        with self._lock:
            return sorted(self._by_replica)

    def stats(self) -> dict[str, int]:
        """Sizes and counters: num_hashes, num_entries, max_blocks, num_replicas,
        replicas_needing_resync, closed_replicas, and batches_applied / batches_ignored /
        gaps / resyncs / matches (of them bisected_matches) / evicted_entries since start."""
        with self._lock:
            return {"num_hashes": len(self._holders), "num_entries": self._num_entries,
                    "max_blocks": self._max_blocks, "num_replicas": len(self._by_replica),
                    "replicas_needing_resync": len(self._resync_needed),
                    "closed_replicas": len(self._closed), **self._counters}

    def check_integrity(self) -> None:
        """Raise AssertionError if the two maps disagree or the bound is broken."""
        with self._lock:
            pairs = {(h, r) for h, holders in self._holders.items() for r in holders}
            assert all(m for holders in self._holders.values() for m in holders.values()), \
                "entry with an empty tier mask"
            mirror = {(h, r) for r, hashes in self._by_replica.items() for h in hashes}
            assert pairs == mirror, "holders and per-replica sets disagree"
            assert len(pairs) == self._num_entries, "entry count drifted"
            assert self._num_entries <= self._max_blocks, "bound exceeded"
            host_only = sum(m == _HOST_ONLY for hs in self._holders.values() for m in hs.values())
            assert host_only == self._host_only, "host-only count drifted"
            assert all(self._holders.values()), "hash kept with no holder"
            assert self._closed <= set(self._by_replica) - self._trimmed, \
                "a replica counted closed that is unknown or lost hashes to the bound"

    # ---- internals (lock held) ---------------------------------------------------------
    def _set_closed(self, replica_id: ReplicaId, closed: bool) -> None:
        if closed and replica_id not in self._trimmed:
            self._closed.add(replica_id)
        else:
            self._closed.discard(replica_id)

    def _store(self, replica_id: ReplicaId, hashes: Iterable[BlockHash], bit: int) -> None:
        mine = self._by_replica.setdefault(replica_id, set())
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = {}
            else:
                self._holders.move_to_end(h)
            mask = holders.get(replica_id, 0)
            if mask == 0:
                mine.add(h)
                self._num_entries += 1
            holders[replica_id] = new = mask | bit
            self._host_only += (new == _HOST_ONLY) - (mask == _HOST_ONLY)

    def _unset(self, replica_id: ReplicaId, h: BlockHash, bit: int) -> None:
        holders = self._holders.get(h)
        mask = holders.get(replica_id, 0) if holders else 0
        if not mask:
            return                       # already forgotten (evicted here) or never stored
        new = mask & ~bit
        self._host_only += (new == _HOST_ONLY) - (mask == _HOST_ONLY)
        if new:
            holders[replica_id] = new
            return
        del holders[replica_id]
        self._by_replica[replica_id].discard(h)
        self._num_entries -= 1
        if not holders:
            del self._holders[h]

    def _drop_replica(self, replica_id: ReplicaId) -> None:
        for h in self._by_replica.pop(replica_id, ()):
            holders = self._holders[h]
            self._host_only -= holders.pop(replica_id) == _HOST_ONLY
            self._num_entries -= 1
            if not holders:
                del self._holders[h]
        self._next_seq.pop(replica_id, None)
        self._resync_needed.discard(replica_id)
        self._closed.discard(replica_id)
        self._trimmed.discard(replica_id)

    def _evict_overflow(self) -> None:
        while self._num_entries > self._max_blocks:
            h, holders = self._holders.popitem(last=False)
            for r, mask in holders.items():
                self._by_replica[r].discard(h)
                self._host_only -= mask == _HOST_ONLY
                self._trimmed.add(r)              # its view may have lost a parent
                self._closed.discard(r)
            self._num_entries -= len(holders)
            self._counters["evicted_entries"] += len(holders)


def shard_of(replica_id: str, num_shards: int) -> int:
    """The directory shard that owns ``replica_id``'s events (stable across processes)."""
    return zlib.crc32(replica_id.encode()) % num_shards if num_shards > 1 else 0


def shard_name(name: str, shard: int, num_shards: int) -> str:
    """Actor name of one shard: ``name`` itself when there is one shard, else ``name/i``."""
    return name if num_shards <= 1 else f"{name}/{shard}"


class DirectoryShard:
    """One shard of the prefix directory: a ``PrefixIndex`` plus the ``EventLog`` of every
    change applied to it (a plain class; ``PrefixDirectory`` is its Ray actor).

    Replicas send their event batches here (each replica to the shard ``shard_of`` names);
    routers do not ask it on every request: they ``poll`` the log (or take a ``snapshot``)
    and answer matches from their own index replica. Methods are synchronous on purpose:
    the actor runs them one at a time in the order each caller submitted them, so one
    replica's batches arrive in sequence order. A restarted actor (``max_restarts``) starts
    empty under a new epoch; replicas see the new epoch in ``heartbeat`` and resync, and
    routers see it in ``poll`` and take a snapshot.
    """

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, max_log_entries: int = 16_384,
                 max_log_hashes: int = 2_000_000) -> None:
        self._index = PrefixIndex(max_blocks)
        self._log = EventLog(max_log_entries, max_log_hashes)

    # ---- writers (replicas, routers) ------------------------------------------------------
    def apply_events(self, replica_id, seq_no, stored=(), removed=(), tier="device",
                     closed=None) -> bool:
        status = self._index.apply_batch(replica_id, seq_no, stored, removed, tier, closed)
        if status == "applied":
            self._log.append(("events", replica_id, seq_no, list(stored), list(removed), tier,
                              closed))
        return status in ("applied", "duplicate")

    def resync(self, replica_id, seq_no, hashes_by_tier, closed=False) -> str:
        """Replace the replica's view; returns the epoch it now belongs to."""
        hashes_by_tier = {tier: list(h) for tier, h in hashes_by_tier.items()}
        self._index.resync(replica_id, seq_no, hashes_by_tier, closed)
        self._log.append(("resync", replica_id, seq_no, hashes_by_tier, closed))
        return self._log.epoch

    def heartbeat(self, replica_id) -> tuple[str, bool]:
        """``(epoch, known)``: ``known`` is False when this shard has no in-order view of
        the replica (never seen, forgotten, or awaiting a resync)."""
        known = (replica_id in self._index.replicas()
                 and not self._index.needs_resync(replica_id))
        return self._log.epoch, known

    def remove_replica(self, replica_id) -> None:
        if replica_id in self._index.replicas():
            self._index.remove_replica(replica_id)
            self._log.append(("remove", replica_id))

    def clear(self) -> None:
        self._index.clear()
        self._log.append(("clear",))

    # ---- readers ---------------------------------------------------------------------------
    def poll(self, epoch=None, cursor: int = 0, max_entries: int = 1024) -> dict:
        """Log entries after ``cursor``: ``{"epoch", "cursor", "entries"}``; when the reader
        is in another epoch or fell behind the log, ``{"epoch", "cursor", "snapshot",
        "closed"}`` (``closed``: the snapshot's replicas known to be prefix-closed)."""
        read = self._log.read(epoch, cursor, max_entries)
        if read is None:
            return {"epoch": self._log.epoch, "cursor": self._log.end,
                    "snapshot": self._index.snapshot(),
                    "closed": self._index.closed_replicas()}
        return {"epoch": read.epoch, "cursor": read.next_cursor, "entries": read.entries}

    def snapshot(self) -> dict:
        return self.poll(None)

    def match(self, block_hashes) -> dict:
        return self._index.match(block_hashes)

    def replica_hashes(self, replica_id) -> set:
        return self._index.replica_hashes(replica_id)

    def needs_resync(self, replica_id) -> bool:
        return self._index.needs_resync(replica_id)

    def next_seq_no(self, replica_id) -> int:
        return self._index.next_seq_no(replica_id)

    def replicas(self) -> list:
        return self._index.replicas()

    def stats(self) -> dict:
        return {**self._index.stats(), **self._log.stats(), "epoch": self._log.epoch}

    def check_integrity(self) -> None:
        self._index.check_integrity()


@ray.remote(num_cpus=0)
class PrefixDirectory(DirectoryShard):
    """``DirectoryShard`` as a named Ray actor (see ``get_or_create_directory``)."""


def get_or_create_directory(name: str = DEFAULT_DIRECTORY_NAME, namespace: str | None = None,
                            max_blocks: int = DEFAULT_MAX_BLOCKS, detached: bool = False):
    """The named ``PrefixDirectory`` actor, created on first call (race-free: get_if_exists).

    The actor restarts without limit when its process dies (``max_restarts=-1``) and then
    rebuilds from the replicas' resyncs. Calls are not retried by Ray (a replica's batch
    sent to a dead directory fails and the replica resyncs instead).

    Call from synchronous code (it talks to the GCS); async code should wrap it in
    ``asyncio.to_thread``. ``detached=True`` lets the directory outlive the job that made it.
    """
    options = {"name": name, "get_if_exists": True, "num_cpus": 0, "max_restarts": -1,
               "max_task_retries": 0}
    if namespace is not None:
        options["namespace"] = namespace
    if detached:
        options["lifetime"] = "detached"
    return PrefixDirectory.options(**options).remote(max_blocks)


def get_or_create_directories(name: str = DEFAULT_DIRECTORY_NAME, namespace: str | None = None,
                              num_shards: int = 1, max_blocks: int = DEFAULT_MAX_BLOCKS,
                              detached: bool = False) -> list:
    """All ``num_shards`` shards (``shard_name``), each bounded by ``max_blocks / num_shards``."""
    per_shard = max(1, max_blocks // max(1, num_shards))
    return [get_or_create_directory(shard_name(name, i, num_shards), namespace, per_shard, detached)
            for i in range(max(1, num_shards))]
