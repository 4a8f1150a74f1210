"""CPU each process of the running app uses, idle and while it serves requests one at a time.

Starts the default app (the builtin model, ``benchmarks/request_path.py``'s setup, behind
``--ingress``: default ``direct``, as ``serve run kvharbor.app`` runs it), then measures
every process's CPU time (``psutil``) over ``--idle-s`` seconds of no traffic and over
``--requests`` premium completions sent one after another, and prints each process's share
of one core in both windows, busiest first. What an idle platform costs, and
where a request's CPU goes.

    python scripts/app_cpu.py [--idle-s 10] [--requests 60] [--ingress direct|proxy]
    (psutil: the test extras)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """``{pid: (command line, user + system CPU seconds)}`` of every process readable."""
    import psutil  # noqa: PLC0415

    out = {}
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out[p.pid] = (" ".join(p.info["cmdline"] or [p.info["name"] or "?"])[:70], t.user + t.system)
    return out


def shares(before: dict, after: dict, seconds: float) -> dict[int, float]:
    """Per process alive in both snapshots: % of one core over ``seconds``."""
    return {pid: 100.0 * (after[pid][1] - before[pid][1]) / seconds
            for pid in after if pid in before}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--ingress", choices=("direct", "proxy", "haproxy"), default="direct")
    args = ap.parse_args(argv)
    from benchmarks import request_path as rp  # noqa: PLC0415
    from kvharbor.platform.app import default_tenants_path  # noqa: PLC0415

    base = rp.serve_app(default_tenants_path(), args.ingress)
    try:
        rp.http_ttfts(base, rp.prompts(8, 101))            # warm-up
        time.sleep(3.0)
        a, t0 = cpu_seconds(), time.monotonic()
        time.sleep(args.idle_s)
        b, idle_s = cpu_seconds(), time.monotonic() - t0
        c, t0 = cpu_seconds(), time.monotonic()
        ttfts, timings, _ = rp.http_ttfts(base, rp.prompts(args.requests, 102))
        d, busy_s = cpu_seconds(), time.monotonic() - t0
    finally:
        rp.stop_app()
    idle, busy = shares(a, b, idle_s), shares(c, d, busy_s)
    n = len(ttfts) + 4                                      # http_ttfts sends 4 warm-ups first
    print(f"idle window {idle_s:.1f} s; busy window {busy_s:.1f} s, {n} requests one at a time "
          f"(client TTFT p50 {sorted(ttfts)[len(ttfts) // 2]:.1f} ms)")
    print(f"{'busy %core':>10} {'idle %core':>10} {'busy ms/request':>16}  process")
    for pid in sorted(busy, key=busy.get, reverse=True)[:args.top]:
        per_request = busy[pid] / 100.0 * busy_s / n * 1000.0
        print(f"{busy[pid]:10.1f} {idle.get(pid, float('nan')):10.1f} {per_request:16.2f}  {d[pid][0]}")
    print(f"all processes: busy {sum(busy.values()):.1f} %core, idle {sum(idle.values()):.1f} %core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
