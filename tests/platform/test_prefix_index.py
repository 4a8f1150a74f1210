"""PrefixIndex behaviour; the same suite runs against the plain class and the Ray actor."""

from __future__ import annotations

import ast
import os
import random
import subprocess
import sys
import threading
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.actors.prefix_directory import MatchInfo, PrefixIndex, shard_of
from kvharbor.engine.hashing import BlockHash, hash_prompt_blocks


def chain(n: int, salt: str = "t") -> list[BlockHash]:
    """``n`` chained block hashes of a distinct prompt per ``salt``."""
    return hash_prompt_blocks(list(range(n * 4)), 4, salt=salt)


class _ActorProxy:
    """Calls a PrefixDirectory actor synchronously, so tests read like the plain class."""

    def __init__(self, ray, handle) -> None:
        self._ray, self._handle = ray, handle

    def __getattr__(self, name):
        method = getattr(self._handle, name)
        return lambda *args, **kwargs: self._ray.get(method.remote(*args, **kwargs))


@pytest.fixture(scope="module")
def directory_actors():
    """One actor per ``max_blocks`` for the whole module (actor start-up is slow on 2 cores)."""
    actors = {}
    yield actors
    for ray, handle in actors.values():
        ray.kill(handle)


@pytest.fixture(params=["plain", "actor"])
def make_index(request, directory_actors):
    """Factory: ``make_index(max_blocks=...)`` -> empty PrefixIndex or a proxy to the actor."""

    def make(max_blocks: int = 1_000_000):
        if request.param == "plain":
            return PrefixIndex(max_blocks)
        if max_blocks not in directory_actors:
            ray = request.getfixturevalue("ray_cluster")
            from kvharbor.actors.prefix_directory import PrefixDirectory

            directory_actors[max_blocks] = (ray, PrefixDirectory.remote(max_blocks))
        proxy = _ActorProxy(*directory_actors[max_blocks])
        proxy.clear()
        return proxy

    return make


def test_match_counts_leading_blocks_and_stops_at_first_miss(make_index):
    idx = make_index()
    h = chain(6)
    assert idx.apply_events("a", 0, stored=h[:5])
    assert idx.apply_events("b", 0, stored=h[:2] + h[3:6])   # hole at block 2
    assert idx.apply_events("c", 0, stored=h[1:6])            # lacks the first block
    got = idx.match(h)
    assert got == {"a": MatchInfo(5, 5, 0), "b": MatchInfo(2, 2, 0)}
    assert idx.match(chain(3, salt="other")) == {}
    assert idx.match([]) == {}
    idx.check_integrity()


def test_host_tier_counts_separately_and_device_wins(make_index):
    idx = make_index()
    h = chain(4)
    assert idx.apply_events("a", 0, stored=h)
    assert idx.apply_events("a", 1, stored=h[2:], tier="host")     # offloaded copies
    assert idx.match(h)["a"] == MatchInfo(4, 4, 0)                  # device copy wins
    assert idx.apply_events("a", 2, removed=h[2:], tier="device")  # device copies evicted
    assert idx.match(h)["a"] == MatchInfo(4, 2, 2)
    assert idx.apply_events("a", 3, removed=h[3:], tier="host")
    assert idx.match(h)["a"] == MatchInfo(3, 2, 1)
    idx.check_integrity()


def test_removed_blocks_no_longer_match_and_unknown_removals_are_harmless(make_index):
    idx = make_index()
    h = chain(4)
    assert idx.apply_events("a", 0, stored=h)
    assert idx.apply_events("a", 1, removed=[h[1], chain(1, "never")[0]])
    assert idx.match(h) == {"a": MatchInfo(1, 1, 0)}
    assert idx.replica_hashes("a") == {h[0], h[2], h[3]}
    idx.check_integrity()


def test_gap_marks_resync_and_ignores_batches_until_resync(make_index):
    idx = make_index()
    h = chain(5)
    assert idx.apply_events("a", 0, stored=h[:2])
    assert not idx.apply_events("a", 2, stored=h[2:3])          # batch 1 lost
    assert idx.needs_resync("a")
    assert not idx.apply_events("a", 3, stored=h[3:4])          # ignored while waiting
    assert idx.match(h)["a"].blocks == 2                        # last known view stays
    idx.resync("a", 7, {"device": h[:4], "host": h[4:]})
    assert not idx.needs_resync("a")
    assert idx.match(h)["a"] == MatchInfo(5, 4, 1)
    assert not idx.apply_events("a", 9, stored=[])              # expects 8 after resync
    idx.resync("a", 8, {"device": h[:1]})
    assert idx.replica_hashes("a") == {h[0]}                    # view replaced, not merged
    assert idx.apply_events("a", 9, removed=h[:1])
    assert idx.match(h) == {}
    stats = idx.stats()
    counts = {k: stats[k] for k in ("batches_applied", "batches_ignored", "gaps", "resyncs")}
    assert counts == {"batches_applied": 2, "batches_ignored": 1, "gaps": 2, "resyncs": 2}
    idx.check_integrity()


def test_first_batch_must_be_zero_and_duplicates_are_ignored(make_index):
    idx = make_index()
    h = chain(3)
    assert not idx.apply_events("late", 4, stored=h)            # directory missed 0..3
    assert idx.needs_resync("late")
    assert idx.apply_events("a", 0, stored=h[:1])
    assert idx.apply_events("a", 1, stored=h[1:2])
    assert idx.apply_events("a", 1, stored=h[2:3])              # duplicate: not applied
    assert idx.next_seq_no("a") == 2
    assert idx.match(h)["a"].blocks == 2
    assert not idx.needs_resync("a")
    stats = idx.stats()
    counts = {k: stats[k] for k in ("batches_applied", "batches_ignored", "gaps")}
    assert counts == {"batches_applied": 2, "batches_ignored": 1, "gaps": 1}


def test_remove_replica_forgets_it_and_restarts_its_sequence(make_index):
    idx = make_index()
    h = chain(3)
    assert idx.apply_events("a", 0, stored=h)
    assert idx.apply_events("b", 0, stored=h[:1])
    idx.remove_replica("a")
    assert idx.match(h) == {"b": MatchInfo(1, 1, 0)}
    assert idx.replica_hashes("a") == set()
    assert idx.replicas() == ["b"]
    assert idx.apply_events("a", 0, stored=h[:2])               # a fresh start at 0
    assert idx.match(h)["a"].blocks == 2
    assert idx.stats()["num_entries"] == 3
    idx.check_integrity()
    assert not idx.apply_events("b", 5, stored=h)                # a gap: awaiting a resync
    idx.remove_replica("b")
    assert not idx.needs_resync("b")
    assert idx.apply_events("b", 0, stored=h[:1])               # forgotten: starts afresh
    assert idx.match(h)["b"].blocks == 1


def test_memory_bound_evicts_least_recently_stored_or_matched(make_index):
    idx = make_index(max_blocks=6)
    old, hot, new = chain(2, "old"), chain(2, "hot"), chain(2, "new")
    assert idx.apply_events("a", 0, stored=old)
    assert idx.apply_events("a", 1, stored=hot)
    assert idx.apply_events("b", 0, stored=hot)    # 6 entries: old x1, hot x2
    assert idx.match(old)["a"].blocks == 2         # old becomes most recent
    assert idx.apply_events("a", 2, stored=new)    # 8 > 6: LRU hash hot[0] (2 entries) goes
    assert idx.match(hot) == {}                    # its first block is gone for a and b
    assert idx.replica_hashes("b") == {hot[1]}
    assert idx.match(old)["a"].blocks == 2
    assert idx.match(new)["a"].blocks == 2
    stats = idx.stats()
    assert stats["num_entries"] <= 6 and stats["evicted_entries"] == 2
    assert idx.apply_events("b", 1, removed=hot)   # removal of forgotten blocks is a no-op
    idx.check_integrity()


def test_the_bound_forgetting_a_host_only_entry_keeps_the_host_count(make_index):
    """Host-only entries are counted (while any exist, a router's read-only match takes the
    slow path that counts host blocks); one the bound forgets leaves the count."""
    idx = make_index(max_blocks=3)
    host, dev = chain(2, "host"), chain(2, "dev")
    assert idx.apply_events("a", 0, stored=host, tier="host")
    assert idx.apply_events("a", 1, stored=dev)                  # 4 > 3: host[0] goes
    assert idx.match(host) == {}
    idx.check_integrity()
    assert idx.apply_events("a", 2, stored=chain(2, "more"))     # host[1] goes too
    idx.check_integrity()


def test_a_hash_stored_again_becomes_the_most_recent(make_index):
    """A hash another replica stores (a second holder of a popular prefix) is fresh again for
    the bound: an older hash is forgotten before it."""
    idx = make_index(max_blocks=4)
    shared, other = chain(1, "shared"), chain(1, "other")
    assert idx.apply_events("a", 0, stored=shared)
    assert idx.apply_events("a", 1, stored=other)
    assert idx.apply_events("b", 0, stored=shared)        # 3 entries; shared is the newest
    assert idx.apply_events("c", 0, stored=chain(2, "new"))   # 5 > 4: the LRU hash goes
    assert idx.match(other) == {}
    assert set(idx.match(shared)) == {"a", "b"}
    idx.check_integrity()


def test_clear_forgets_everything(make_index):
    """Also a replica that was awaiting a resync: after a clear its batch 0 is applied."""
    idx = make_index()
    assert idx.apply_events("a", 0, stored=chain(2))
    assert idx.apply_events("h", 0, stored=chain(3), tier="host")
    assert not idx.apply_events("b", 4, stored=chain(1))         # a gap: awaiting a resync
    idx.clear()
    assert idx.match(chain(2)) == {} and idx.replicas() == []
    stats = idx.stats()
    assert stats["batches_applied"] == 0 and stats["num_entries"] == 0
    assert idx.next_seq_no("a") == 0 and not idx.needs_resync("b")
    idx.check_integrity()
    assert idx.apply_events("b", 0, stored=chain(1))
    assert idx.match(chain(1))["b"].blocks == 1
    idx.check_integrity()


def test_unknown_tier_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="unknown KV tier 'disk'"):
        PrefixIndex().apply_events("a", 0, stored=chain(1), tier="disk")
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixIndex(0)


def test_random_operations_agree_with_a_brute_force_model():
    """No bound: the index must answer exactly like a dict of sets per tier."""
    rng = random.Random(7)
    idx, model = PrefixIndex(), {}        # model: (replica, tier) -> set of hashes
    pool = chain(12, "x") + chain(12, "y")
    seq = {}
    for _ in range(600):
        r, tier = rng.choice("abc"), rng.choice(["device", "host"])
        if rng.random() < 0.05:
            idx.remove_replica(r)
            seq.pop(r, None)
            model = {k: v for k, v in model.items() if k[0] != r}
            continue
        stored, removed = rng.sample(pool, 3), rng.sample(pool, 2)
        assert idx.apply_events(r, seq.get(r, 0), stored, removed, tier)
        seq[r] = seq.get(r, 0) + 1
        model.setdefault((r, tier), set()).update(stored)
        model[(r, tier)].difference_update(removed)
        for prompt in (pool[:12], pool[12:]):
            assert idx.match(prompt) == _model_match(model, prompt)
    idx.check_integrity()


def _model_match(model, prompt):
    out = {}
    for r in "abc":
        dev, host = model.get((r, "device"), set()), model.get((r, "host"), set())
        d = hst = 0
        for h in prompt:
            if h in dev:
                d += 1
            elif h in host:
                hst += 1
            else:
                break
        if d + hst:
            out[r] = MatchInfo(d + hst, d, hst)
    return out


def test_concurrent_writers_and_readers_keep_the_index_consistent():
    idx = PrefixIndex(max_blocks=500)
    prompts = [chain(40, f"p{i}") for i in range(8)]
    errors = []

    def writer(rid: str) -> None:
        try:
            for seq, p in enumerate(prompts * 5):
                assert idx.apply_events(rid, seq, stored=p, removed=p[30:])
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    def reader() -> None:
        try:
            for p in prompts * 20:
                for info in idx.match(p).values():
                    assert info.blocks == info.device_blocks <= 30, info
        except Exception as exc:  # noqa: BLE001 - a thread's assert only warns: surface it
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(f"r{i}",)) for i in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    idx.check_integrity()
    assert idx.stats()["num_entries"] <= 500


def test_named_directory_is_shared_between_callers(ray_cluster):
    from kvharbor.actors.prefix_directory import get_or_create_directory

    first = get_or_create_directory(name="kvh-test-directory", namespace="kvh-tests")
    second = get_or_create_directory(name="kvh-test-directory", namespace="kvh-tests")
    try:
        assert ray_cluster.get(first.apply_events.remote("a", 0, chain(2)))
        got = ray_cluster.get(second.match.remote(chain(2)))
        assert got == {"a": MatchInfo(2, 2, 0)}
    finally:
        ray_cluster.kill(first)


def test_snapshot_reproduces_every_view_and_names_batch_outcomes():
    idx, h = PrefixIndex(), chain(6)
    assert idx.apply_batch("a", 0, stored=h[:4]) == "applied"
    assert idx.apply_batch("a", 0, stored=h[4:]) == "duplicate"
    assert idx.apply_batch("a", 1, stored=h[2:4], tier="host") == "applied"
    assert idx.apply_batch("b", 0, stored=h[:2]) == "applied"
    assert idx.apply_batch("c", 3, stored=h) == "gap"
    assert idx.apply_batch("c", 4, stored=h) == "awaiting_resync"
    snap = idx.snapshot()
    assert set(snap) == {"a", "b"}                     # c's view is known to be incomplete
    copy = PrefixIndex()
    for r, (seq, tiers) in snap.items():
        copy.resync(r, seq, tiers)
    for r in ("a", "b"):
        assert copy.replica_hashes(r) == idx.replica_hashes(r)
        assert copy.next_seq_no(r) == idx.next_seq_no(r)
    assert copy.match(h) == idx.match(h) == {"a": MatchInfo(4, 4, 0), "b": MatchInfo(2, 2, 0)}


def test_a_read_only_match_does_not_refresh_the_lru_order():
    idx = PrefixIndex(max_blocks=4)
    old, new = chain(2, "old"), chain(2, "new")
    assert idx.apply_events("a", 0, stored=old)
    assert idx.apply_events("a", 1, stored=new)
    idx.match(old, touch=False)
    assert idx.apply_events("a", 2, stored=chain(1, "newer"))   # evicts the LRU hash: old[0]
    assert idx.match(old) == {}
    assert idx.match(new)["a"].blocks == 2


@given(st.lists(st.tuples(st.sampled_from("abcdefghijkl"), st.booleans(),
                          st.one_of(st.just(0), st.integers(0, 11)), st.integers(1, 12),
                          st.sampled_from(["device"] * 5 + ["host"])), max_size=40),
       st.integers(0, 12), st.booleans())
@settings(max_examples=400, deadline=None)
def test_a_read_only_match_counts_what_each_replica_holds_in_a_row(events, probe_len, host):
    """``match(touch=False)`` (the router's fast path, and its fallback with many holders)
    against a model: per replica, the leading blocks it holds in any tier, device ones apart."""
    idx, h = PrefixIndex(), chain(12)
    held: dict[str, dict[BlockHash, set[str]]] = {}
    seq: dict[str, int] = {}
    for replica, store, start, length, tier in events:
        tier = tier if host else "device"        # without host-only entries: the fast path
        blocks = h[start:start + length]
        mine = held.setdefault(replica, {})
        for b in blocks:
            tiers = mine.setdefault(b, set())
            tiers.add(tier) if store else tiers.discard(tier)
        # Say truly whether the replica's blocks are a prefix of the chain (every parent
        # held), as an engine does: closed replicas are matched by bisection.
        have = [bool(mine.get(b)) for b in h]
        closed = all(have[i - 1] for i in range(1, len(h)) if have[i])
        kwargs = {"stored": blocks} if store else {"removed": blocks}
        assert idx.apply_events(replica, seq.get(replica, 0), tier=tier, closed=closed, **kwargs)
        assert idx.is_closed(replica) == closed
        seq[replica] = seq.get(replica, 0) + 1
    probe = h[:probe_len]
    want = {}
    for replica, mine in held.items():
        k = next((i for i, b in enumerate(probe) if not mine.get(b)), len(probe))
        if k:
            host = sum(mine[b] == {"host"} for b in probe[:k])
            want[replica] = MatchInfo(k, k - host, host)
    assert idx.match(probe, touch=False) == want
    assert idx.match(probe, touch=True) == want
    idx.check_integrity()


def test_a_read_only_match_with_many_holders_of_the_first_block():
    """More than 8 replicas hold the first block: the read-only match falls back to the
    one-pass loop."""
    idx, h = PrefixIndex(), chain(12)
    for i in range(10):
        assert idx.apply_events(f"r{i}", 0, stored=h[:i + 1])
    want = {f"r{i}": MatchInfo(i + 1, i + 1, 0) for i in range(10)}
    assert idx.match(h, touch=False) == want == idx.match(h, touch=True)


class _CountingHolders(OrderedDict):
    """The index's hash -> holders map, counting lookups."""

    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


class _CountingSet(set):
    """A replica's hash set in the index, counting membership tests into ``counter``."""

    def __init__(self, items, counter: _CountingHolders) -> None:
        super().__init__(items)
        self.counter = counter

    def __contains__(self, key) -> bool:
        self.counter.lookups += 1
        return super().__contains__(key)


def _count_lookups(idx: PrefixIndex) -> _CountingHolders:
    """Count the index's lookups from now on: in its hash -> holders map and in the replicas'
    hash sets (a closed replica's bisection probes its set)."""
    idx._holders = counter = _CountingHolders(idx._holders)
    idx._by_replica = {r: _CountingSet(hs, counter) for r, hs in idx._by_replica.items()}
    return counter


def test_closed_replicas_are_matched_by_bisection_in_a_few_lookups():
    """Four replicas hold prefixes of one 110-block chain. Said to be prefix-closed, each is
    matched by bisection (the lookups of a 110-block match fall from 110 to ~log2 per
    replica); not said so, block by block. The answers are the same."""
    h, ends = chain(110), {"a": 110, "b": 97, "c": 40, "d": 1}
    closed, unknown = PrefixIndex(), PrefixIndex()
    for r, k in ends.items():
        assert closed.apply_events(r, 0, stored=h[:k], closed=True)
        assert unknown.apply_events(r, 0, stored=h[:k])
    want = {r: MatchInfo(k, k, 0) for r, k in ends.items()}
    fast, slow = _count_lookups(closed), _count_lookups(unknown)
    assert closed.match(h, touch=False) == want == unknown.match(h, touch=False)
    assert fast.lookups <= 1 + 4 * 7, fast.lookups
    assert slow.lookups >= 110
    assert closed.stats()["bisected_matches"] == 1 and unknown.stats()["bisected_matches"] == 0
    assert closed.stats()["matches"] == 1 == unknown.stats()["matches"]
    assert closed.match(h[:60], touch=False) == {"a": MatchInfo(60, 60, 0),
                                                 "b": MatchInfo(60, 60, 0),
                                                 "c": MatchInfo(40, 40, 0),
                                                 "d": MatchInfo(1, 1, 0)}
    assert closed.match(chain(3, "other"), touch=False) == {}


def test_one_replica_not_known_closed_sends_the_match_block_by_block():
    """A replica with a hole (h3 evicted, h4.. kept) that did not say it is closed: a
    bisection would read 8 blocks for it; the answer must be 3, for it and the others."""
    h = chain(8)
    idx = PrefixIndex()
    assert idx.apply_events("a", 0, stored=h, closed=True)
    assert idx.apply_events("b", 0, stored=h, closed=True)
    assert idx.apply_events("b", 1, removed=[h[3]], closed=False)
    assert idx.match(h, touch=False) == {"a": MatchInfo(8, 8, 0), "b": MatchInfo(3, 3, 0)}
    assert idx.apply_events("b", 2, stored=[h[3]])                   # None: unchanged
    assert not idx.is_closed("b") and idx.closed_replicas() == ["a"]
    assert idx.apply_events("b", 3, closed=True)
    assert idx.is_closed("b")
    idx.check_integrity()


def test_a_view_the_bound_trimmed_stays_unclosed_until_its_resync():
    """The index's own bound forgets the least recently stored hash: here h1, while h0 was
    stored again and h2.. are kept. The replica's cache is still closed and says so, but
    the index's view of it has a hole: it must be matched block by block (1 block, not 6)
    until a resync replaces the view."""
    h = chain(6)
    idx = PrefixIndex(max_blocks=6)
    assert idx.apply_events("a", 0, stored=h, closed=True)
    assert idx.apply_events("a", 1, stored=[h[0]], closed=True)     # h0 now most recent
    assert idx.apply_events("a", 2, stored=chain(1, "new"), closed=True)   # evicts h1
    assert not idx.is_closed("a")
    assert idx.apply_events("a", 3, stored=[h[0]], closed=True)
    assert not idx.is_closed("a")
    assert idx.match(h, touch=False) == {"a": MatchInfo(1, 1, 0)}
    idx.resync("a", 3, {"device": h[:5]}, closed=True)
    assert idx.is_closed("a")
    assert idx.match(h, touch=False) == {"a": MatchInfo(5, 5, 0)}
    idx.check_integrity()
    idx.remove_replica("a")
    assert idx.closed_replicas() == [] and idx.stats()["closed_replicas"] == 0


def test_a_replicas_shard_is_the_same_in_every_process():
    """Replicas send their events to the shard ``shard_of`` names and routers in other
    processes follow that shard: the mapping must not change with the process (Python's own
    string hash is salted per process)."""
    here = [shard_of(f"replica-{i}", 4) for i in range(16)]
    assert len(set(here)) > 1
    code = ("from kvharbor.actors.prefix_directory import shard_of; "
            "print([shard_of(f'replica-{i}', 4) for i in range(16)])")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        assert ast.literal_eval(out.strip()) == here, seed
