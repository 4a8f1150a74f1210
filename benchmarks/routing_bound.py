"""Helpers of ``routing_sim.py``: the offline upper bound and the index cost measurements."""

from __future__ import annotations

import asyncio
import heapq
import os
import random
import sys
import time
import types

from kvharbor.actors.prefix_directory import DirectoryShard, PrefixIndex
from kvharbor.platform.index_follower import IndexFollower

NEVER = float("inf")


def belady_hit_blocks(requests: list[list], capacity: int) -> list[int]:
    """Block hits per request of one cache of ``capacity`` blocks under Belady's optimal
    offline replacement (evict the block used farthest in the future; a block never used
    again is not kept). Each request references its block hashes in order.

    This bounds any routing over replicas whose capacities sum to ``capacity``: the union
    of their caches is one such cache, and a prefix hit is a block hit.
    """
    refs = [h for hashes in requests for h in hashes]
    next_use = [NEVER] * len(refs)
    seen: dict = {}
    for i in range(len(refs) - 1, -1, -1):
        next_use[i] = seen.get(refs[i], NEVER)
        seen[refs[i]] = i
    cached: dict = {}                         # hash -> its next use
    heap: list = []                           # (-next use, hash), lazily invalidated
    out, i = [], 0
    for hashes in requests:
        hits = 0
        for h in hashes:
            nxt = next_use[i]
            i += 1
            if h in cached:
                hits += 1
            elif nxt == NEVER:
                continue                      # bypass: never needed again
            elif len(cached) >= capacity:
                while True:
                    far, victim = heapq.heappop(heap)
                    if cached.get(victim) == -far:
                        break
                if -far <= nxt:               # keeping what we have is better
                    heapq.heappush(heap, (far, victim))
                    continue
                del cached[victim]
            if nxt == NEVER:
                cached.pop(h, None)
            else:
                cached[h] = nxt
                heapq.heappush(heap, (-nxt, h))
        out.append(hits)
    return out


def index_costs(replicas: int = 256, batches: int = 20_000, seed: int = 0) -> dict:
    """Ingest into one shard, follower replay, match time and memory, at ``replicas``."""
    rng = random.Random(seed)
    ids = [f"replica-{i}" for i in range(replicas)]
    shard = DirectoryShard(max_blocks=4_000_000, max_log_entries=batches + 10)
    held: dict[str, list] = {r: [] for r in ids}
    plan = []
    for b in range(batches):
        r = ids[b % replicas]
        stored = [rng.randbytes(16) for _ in range(16)]
        removed = held[r][:8] if len(held[r]) > 256 else []
        held[r] = held[r][len(removed):] + stored
        plan.append((r, b // replicas, stored, removed))
    t0 = time.perf_counter()
    for r, seq, stored, removed in plan:
        shard.apply_events(r, seq, stored, removed)
    ingest_s = time.perf_counter() - t0
    events = sum(len(s) + len(x) for _, _, s, x in plan)
    entries = shard.poll(shard.poll(None, 0)["epoch"], 0, batches + 10)   # the whole log
    follower = IndexFollower([None])
    t0 = time.perf_counter()
    asyncio.run(follower.apply(0, entries))
    replay_s = time.perf_counter() - t0
    return {"replicas": replicas, "batches": batches, "block_events": events,
            "ingest_block_events_per_s": events / ingest_s,
            "replay_block_events_per_s": events / replay_s,
            "match_us_p50": _match_us(replicas),
            "bytes_per_entry": bytes_per_entry(), "cpu_count": os.cpu_count()}


def _match_us(replicas: int, holders: int = 64, blocks: int = 375) -> float:
    """p50 time of ``match`` for a 375-block prompt whose prefix ``holders`` replicas hold."""
    idx = PrefixIndex()
    prompt = [os.urandom(16) for _ in range(blocks)]
    for i in range(replicas):
        n = blocks if i < holders else 0
        idx.apply_events(f"replica-{i}", 0, prompt[: n - i % 50] if n else [os.urandom(16)])
    times = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        idx.match(prompt)
        times.append(time.perf_counter_ns() - t0)
    return sorted(times)[len(times) // 2] / 1000


def bytes_per_entry(hashes: int = 50_000, holders: int = 2) -> float:
    """Bytes per (hash, replica) entry of a ``PrefixIndex``, hash objects included: the deep
    ``sys.getsizeof`` of everything the index references, divided by its entries.

    Deterministic and safe in any process (``tracemalloc`` was used before: its ``stop()``
    races native threads that untrack memory without the GIL, and it crashed a pytest
    process that had Ray and torch threads). Allocator rounding is not counted.
    """
    idx = PrefixIndex()
    chunks = [[os.urandom(16) for _ in range(1000)] for _ in range(hashes // 1000)]
    for seq, chunk in enumerate(chunks):
        for r in range(holders):
            idx.apply_events(f"replica-{r}", seq, chunk)
    del chunks
    return deep_size(idx) / idx.stats()["num_entries"]


def deep_size(obj, seen: set | None = None) -> int:
    """``sys.getsizeof`` of ``obj`` and of every object it references (containers, instance
    attributes), each counted once; classes, functions and modules are not followed."""
    seen = set() if seen is None else seen
    stack, total = [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType,
                                            types.BuiltinFunctionType, types.MethodType)):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        if hasattr(o, "__dict__"):
            stack.append(vars(o))
        for name in getattr(type(o), "__slots__", ()):
            if hasattr(o, name):
                stack.append(getattr(o, name))
    return total
