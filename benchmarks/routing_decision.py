"""Cost of one routing decision in the router's process, warm and cold, against Ray's tree.

    python benchmarks/routing_decision.py [--seed N] [--cold-mib 64]

``benchmarks/routing.py`` measures the decision inside real runs; this one explains its
numbers. At that benchmark's rate (about 1.4 requests/s) four replicas compute between two
decisions and push the router's index and code out of the CPU caches, so every decision runs
cold. Here the same decision runs in-process, no Ray cluster, on the same workload
(``routing.workload``: tenants' system prompts, multi-turn histories, the gateway's block
hashes), in two states:

  warm   decisions back to back (a router serving many requests a second)
  cold   ``--cold-mib`` MiB of memory written between two decisions (more than the L2 and
         L3 caches here), as the replicas' compute does in ``routing.py``

Routers (each fed the same replicas' cache contents):
  kvharbor   ``KVAwareRouter.choose_replicas`` on four fake replicas: its local index is
             fed by KV events through an in-process directory shard, each replica's cache an
             LRU of ``--kv-blocks`` blocks filled by the requests routed to it, freed tail
             first as the engine does. Each batch says whether the cache is prefix-closed
             (checked against the requests' chains), so closed replicas are matched by
             bisection.
  kvharbor_unclosed   the same, with no batch saying so: every match block by block (the
             router before bisection).
  ray_tree   the in-memory work of Ray's ``PrefixCacheAffinityRouter`` (``PrefixTree``, the
             class its tree actor runs): ``prefix_match`` and, below the 10 % match rate,
             ``get_smallest_tenants``; inserts after the decision, as its router does. Its two
             actor calls per decision are *not* counted (in ``routing.py`` they cost 2-6 ms).

Reports decision p50/p99, CPU time of the thread (``time.thread_time``) and wall clock, in
ms. Writes benchmarks/results/routing_decision.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine, pct, result_name, table, write_json  # noqa: E402

REPLICAS = [f"replica-{i}" for i in range(4)]


class LocalShard:
    """A directory shard in this process, polled like the Ray actor (no remote call)."""

    def __init__(self) -> None:
        from kvharbor.actors.prefix_directory import DirectoryShard

        self.shard = DirectoryShard()

    async def poll(self, epoch, cursor, max_entries):
        return self.shard.poll(epoch, cursor, max_entries)

    async def call(self, method, *args):
        return getattr(self.shard, method)(*args)


class FakeReplica:
    """What ``choose_replicas`` reads from Serve's ``RunningReplica``."""

    def __init__(self, uid: str) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id=uid,
                                    deployment_id=DeploymentID(name="LLMReplica", app_name="bench"))
        self.routing_stats: dict = {}
        self.max_ongoing_requests = 64


class ReplicaCaches:
    """Each replica's cached blocks as an LRU of ``capacity`` blocks; every routed request's
    blocks are stored (and the oldest evicted) and published to ``shard`` as KV events."""

    def __init__(self, shard, capacity: int, say_closed: bool = True) -> None:
        self.shard, self.capacity, self.say_closed = shard, capacity, say_closed
        self.lru = {r: OrderedDict() for r in REPLICAS}
        self.seq = dict.fromkeys(REPLICAS, 0)
        self.parent: dict = {}
        self.batches = self.closed_batches = 0

    def serve(self, replica: str, hashes) -> None:
        lru = self.lru[replica]
        stored = [h for h in hashes if h not in lru]
        for i, h in enumerate(hashes):
            self.parent[h] = hashes[i - 1] if i else None
        for h in reversed(hashes):                    # freed tail first: parents stay longer
            lru[h] = None
            lru.move_to_end(h)
        removed = []
        while len(lru) > self.capacity:
            removed.append(lru.popitem(last=False)[0])
        closed = all(self.parent[h] is None or self.parent[h] in lru for h in lru)
        self.batches += 1
        self.closed_batches += closed
        self.shard.apply_events(replica, self.seq[replica], stored, removed,
                                closed=closed if self.say_closed else None)
        self.seq[replica] += 1

    def stats(self, replica: str) -> dict:
        used = len(self.lru[replica])
        return {"block_size": 16, "free_shared_blocks": self.capacity, "free_pinned_blocks": 0,
                "blocks_total": self.capacity, "num_running": 0, "num_waiting": 0,
                "queue_by_priority": {}, "sessions": [], "at": time.time(),
                "empty_shared_blocks": self.capacity - used, "shared_blocks": self.capacity}


def requests(args) -> list:
    """The workload's requests in send order (conversation turns interleaved by start time)."""
    from benchmarks.routing import make_request, workload
    from kvharbor.engine.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    wl = SimpleNamespace(tenants=args.tenants, system_tokens=args.system_tokens, user_tokens=60,
                         answer_tokens=40, turns=3, conversations=args.conversations,
                         conv_rate=0.5, think_s=1.0, tenant_zipf=args.tenant_zipf)
    convs = workload(wl, args.seed)
    sends = sorted((c.start_s + 2.0 * k, ci, k) for ci, c in enumerate(convs) for k in range(3))
    return [make_request(tokenizer, convs[ci].turns[k], convs[ci].tenant, f"c{ci}-{k}", 8)
            for _, ci, k in sends]


def evictor(mib: int):
    """A function that writes ``mib`` MiB (None for warm runs)."""
    if not mib:
        return None
    import numpy as np

    buf = np.zeros(mib << 20, dtype=np.uint8)

    def evict() -> None:
        buf[:] += 1
    return evict


def run_kvharbor_unclosed(reqs, args, evict) -> tuple[list[float], list[float]]:
    return run_kvharbor(reqs, args, evict, say_closed=False)


def run_kvharbor(reqs, args, evict, say_closed: bool = True) -> tuple[list[float], list[float]]:
    from ray.serve._private.common import DeploymentHandleSource, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from kvharbor.platform.router import KVAwareRouter

    shard = LocalShard()
    caches = ReplicaCaches(shard.shard, args.kv_blocks, say_closed)
    replicas = [FakeReplica(r) for r in REPLICAS]
    router = KVAwareRouter(deployment_id=replicas[0].replica_id.deployment_id,
                           handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    router._ensure_following = lambda: None          # polled below, between decisions
    router.shards = router.follower.shards = [shard]
    wall, cpu = [], []

    async def go() -> None:
        for i, req in enumerate(reqs):
            await router.follower.poll_once()
            for rep in replicas:
                rep.routing_stats = caches.stats(rep.replica_id.unique_id)
            pending = PendingRequest(args=[req], kwargs={}, metadata=RequestMetadata(
                request_id=req.request_id, internal_request_id=f"i{i}"))
            if evict is not None:
                evict()
            ranks = await router.choose_replicas(replicas, pending)
            wall.append(req.metadata["router_decision_ms"])
            cpu.append(req.metadata["router_decision_cpu_ms"])
            chosen = ranks[0][0].replica_id
            router.on_request_routed(pending, chosen, None)
            caches.serve(chosen.unique_id, req.block_hashes)
    asyncio.run(go())
    if caches.closed_batches != caches.batches:
        print(f"  {caches.batches - caches.closed_batches} of {caches.batches} batches not closed")
    return wall, cpu


def run_ray_tree(reqs, args, evict) -> tuple[list[float], list[float]]:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

    from kvharbor.platform.ray_prefix_router import prompt_text

    tree = PrefixTree()
    tree.add_tenants(REPLICAS, time.time())
    wall, cpu = [], []
    for req in reqs:
        text = prompt_text(req.prompt_token_ids)      # Ray reads text; not counted
        if evict is not None:
            evict()
        start, start_cpu = time.perf_counter(), time.thread_time()
        matched, tenants = tree.prefix_match(text, REPLICAS)
        if len(matched) / len(text) < 0.1:           # Ray's default match_rate_threshold
            tenants = tree.get_smallest_tenants()
        cpu.append((time.thread_time() - start_cpu) * 1000.0)
        wall.append((time.perf_counter() - start) * 1000.0)
        tree.insert(text, sorted(tenants)[0], time.time())   # on_request_routed's insert
    return wall, cpu


def summary(router: str, state: str, wall: list[float], cpu: list[float], skip: int) -> dict:
    wall, cpu = wall[skip:], cpu[skip:]
    return {"router": router, "caches": state, "decisions": len(wall),
            "cpu_ms_p50": round(pct(cpu, 50), 4), "cpu_ms_p99": round(pct(cpu, 99), 4),
            "wall_ms_p50": round(pct(wall, 50), 4), "wall_ms_p99": round(pct(wall, 99), 4)}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tenants", type=int, default=24)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--tenant-zipf", type=float, default=0.0)
    ap.add_argument("--conversations", type=int, default=144)
    ap.add_argument("--kv-blocks", type=int, default=800)
    ap.add_argument("--cold-mib", type=int, default=64,
                    help="MiB written between two decisions in the cold state")
    ap.add_argument("--out", type=result_name, default="routing_decision", help="results name")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    info = machine()
    reqs = requests(args)
    skip = len(reqs) // 10                 # the first requests fill empty caches
    rows = []
    for state, mib in (("warm", 0), ("cold", args.cold_mib)):
        for name, run in (("kvharbor", run_kvharbor), ("kvharbor_unclosed", run_kvharbor_unclosed),
                          ("ray_tree", run_ray_tree)):
            for r in reqs:
                r.metadata.clear()
            wall, cpu = run(reqs, args, evictor(mib))
            rows.append(summary(name, state, wall, cpu, skip))
            print(table(rows[-1:], list(rows[-1])), flush=True)
    print(f"\n{len(reqs)} decisions per run ({skip} first ones not counted); "
          f"cold: {args.cold_mib} MiB written between two decisions")
    print(table(rows, list(rows[0])))
    write_json(args.out, {"machine": info, "workload": vars(args), "rows": rows,
                          "load_avg_at_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
