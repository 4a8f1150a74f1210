"""Gateway accounting round trips per request, side by side: the previous path (class queue
actor, then admission actor, awaited one after the other, and the release awaited before the
answer) vs the current one (``enter_and_admit`` in one call; release not awaited).

Ray on loopback, two tiny actors, 200 alternating requests of each path after a warm-up.
Run:  python benchmarks/admission_rtt.py      (about 20 s)
Writes benchmarks/results/admission_rtt.json.
"""
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ray  # noqa: E402

from benchmarks.common import machine, pct, table, write_json  # noqa: E402
from kvharbor.platform.class_queue import ClassQueue  # noqa: E402
from kvharbor.platform.loopback import on_loopback  # noqa: E402
from kvharbor.tenants.admission_actor import AdmissionActor  # noqa: E402

with on_loopback() as ip:
    ray.init(_node_ip_address=ip, include_dashboard=False, num_cpus=2, log_to_driver=False)

@ray.remote(num_cpus=0)
class OldClassQueue:
    def __init__(self): self.q = ClassQueue()
    def enter(self, qos, prio, limit): return self.q.enter(qos, prio, limit)
    def leave(self, qos): self.q.leave(qos)

adm, cq = AdmissionActor.remote(), OldClassQueue.remote()
prio = {"premium": 100, "standard": 50, "batch": 10}
lim = {"requests_per_minute": 100000, "tokens_per_minute": 10**9}

async def old():
    t = time.perf_counter()
    await cq.enter.remote("premium", prio, 1000)
    a = await adm.try_admit.remote("acme", lim, 50, 1)
    mid = time.perf_counter()
    cq.leave.remote("premium"); await adm.release.remote(a.ticket, 51)     # release was awaited
    return (mid - t) * 1000, (time.perf_counter() - t) * 1000

async def new():
    t = time.perf_counter()
    a = await adm.enter_and_admit.remote("premium", prio, 1000, "acme", lim, 50, 1)
    mid = time.perf_counter()
    adm.release_and_leave.remote(a.ticket, "premium", 51)                 # not awaited
    return (mid - t) * 1000, (time.perf_counter() - t) * 1000

async def main():
    for f in (old, new): [await f() for _ in range(20)]                    # warm up
    res = {"old": [], "new": []}
    for _ in range(200):
        for name, f in (("old", old), ("new", new)):
            res[name].append(await f())
            await asyncio.sleep(0.002)
    rows = [{"path": name, "before_router_p50_ms": round(pct([x[0] for x in xs], 50), 2),
             "before_router_p90_ms": round(pct([x[0] for x in xs], 90), 2),
             "with_release_p50_ms": round(pct([x[1] for x in xs], 50), 2),
             "with_release_p90_ms": round(pct([x[1] for x in xs], 90), 2)} for name, xs in res.items()]
    print(table(rows, list(rows[0])))
    write_json("admission_rtt", {"benchmark": "admission_rtt", "rows": rows, "machine": machine()})


asyncio.run(main())
ray.shutdown()
