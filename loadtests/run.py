"""Run a headless Locust load test against kvharbor and write its summary and plots.

    python -m loadtests.run --host http://127.0.0.1:8000 --shape steady --duration 60s --out results/

Steps: (1) ask the server which model it serves (GET /v1/models), (2) compute the integrity
canaries with the offline engine on that model, (3) run ``locust --headless`` on
``loadtests/locustfile.py`` in a subprocess (Locust monkey-patches the process it runs in;
this one stays clean), (4) summarise ``records.jsonl``: ``summary.json``, ``summary.md``,
``latency_over_time.png``, ``hit_rate_over_time.png`` and Locust's own CSVs in ``--out``.

Exit code: 0 when there was no unexpected failure and every canary matched, 1 otherwise,
2 when Locust itself could not run or sent no request.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvharbor.tenants import default_tenants_path
from loadtests import canaries, plots, shapes, summary, workload
from loadtests.records import read_records

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="http://127.0.0.1:8000", help="kvharbor base URL")
    p.add_argument("--shape", default="steady", choices=shapes.SHAPES, help="load shape")
    p.add_argument("--duration", default="60s", help="test length, e.g. 60s, 5m")
    p.add_argument("--users", type=int, default=5, help="capacity-level users (overload doubles them)")
    p.add_argument("--arrival-rate", type=float, default=None,
                   help="open loop: Poisson arrivals at this many requests/s along --shape "
                        "(instead of --users closed-loop users)")
    p.add_argument("--max-in-flight", type=int, default=256,
                   help="open loop: most requests open at once; later arrivals are recorded as dropped")
    p.add_argument("--out", default="results", help="output folder")
    p.add_argument("--tenants", default=None,
                   help="tenants.yaml the server uses (SLOs, pinned prompt; default ./tenants.yaml, "
                        "else the packaged example, as `serve run kvharbor.app` reads it)")
    p.add_argument("--model", default=None, help="served model id (default: asked from /v1/models)")
    p.add_argument("--canaries", default="compute",
                   help="'compute' (offline engine, default), a canaries.json path, or 'off'")
    p.add_argument("--stop-timeout", type=int, default=30,
                   help="seconds users may take to finish their request when the test ends")
    p.add_argument("--canary-device", default="cpu", help="device for computing canaries (match the server)")
    p.add_argument("--canary-dtype", default="auto", help="dtype for computing canaries (match the server)")
    return p.parse_args(argv)


def served_model(host: str) -> str:
    r = httpx.get(host.rstrip("/") + "/v1/models", timeout=30,
                  headers={"Authorization": f"Bearer {workload.api_key('premium')}"})
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def prepare_canaries(args, model: str, info, out: Path) -> Path | None:
    if args.canaries == "off":
        return None
    path = out / "canaries.json"
    if args.canaries != "compute":
        path.write_text(Path(args.canaries).read_text())
        return path
    t = time.perf_counter()
    computed = canaries.compute_canaries(model, info, device=args.canary_device, dtype=args.canary_dtype)
    canaries.save(computed, path)
    print(f"computed {len(canaries.load(path))} canaries on {model} in {time.perf_counter() - t:.1f} s")
    return path


def run_locust(args, model: str, canary_path: Path | None, out: Path) -> int:
    """Locust in a subprocess; returns its exit code. Bounded by the shape plus a grace period."""
    duration = shapes.parse_duration(args.duration)
    env = {**os.environ, "KVH_MODEL": model, "KVH_TENANTS": str(Path(args.tenants).resolve()),
           "KVH_RECORDS": str(out / "records.jsonl"), "KVH_SHAPE": args.shape,
           "KVH_DURATION": str(duration), "KVH_USERS": str(args.users),
           "KVH_CANARIES": str(canary_path) if canary_path else "",
           "KVH_ARRIVAL_RATE": str(args.arrival_rate or ""), "KVH_MAX_IN_FLIGHT": str(args.max_in_flight),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless",
           "--host", args.host, "--csv", str(out / "locust"), "--only-summary",
           "--stop-timeout", str(args.stop_timeout), "--loglevel", "WARNING",
           *(["OpenLoopUser"] if args.arrival_rate else ["PremiumUser", "StandardUser", "BatchUser"])]
    try:
        return subprocess.run(cmd, env=env, cwd=ROOT, timeout=duration + args.stop_timeout + 90).returncode
    except subprocess.TimeoutExpired:
        print("locust did not stop in time; killed", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").unlink(missing_ok=True)
    if args.tenants is None:
        args.tenants = str(default_tenants_path())
    info = workload.read_tenants(args.tenants)
    model = args.model or served_model(args.host)
    canary_path = prepare_canaries(args, model, info, out)
    started = time.time()
    rc = run_locust(args, model, canary_path, out)
    records = read_records(out / "records.jsonl")
    meta = {"host": args.host, "model": model, "shape": args.shape,
            "duration_s": shapes.parse_duration(args.duration), "users": args.users,
            "arrival_rate": args.arrival_rate, "started": started, "locust_exit_code": rc,
            "canaries_enabled": canary_path is not None}
    result = summary.summarize(records, info.ttft_slo_ms, meta)
    if canary_path is not None and result["canaries"]["checks"] == 0:
        result["passed"] = False
        result["canaries"]["note"] = "no canary was checked: the run was too short or every canary failed"
    result["plots"] = [p.name for p in plots.plot_all(records, out, info.ttft_slo_ms)]
    (out / "summary.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    text = summary.markdown(result)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    if not records or rc not in (0, 1):
        return 2
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
