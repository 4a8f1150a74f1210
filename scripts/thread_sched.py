"""Where a busy host's CPU goes, thread by thread: CPU time and run-queue wait, by nice value.

``record`` samples every thread of every process once a second (``/proc/<pid>/task/<tid>/``:
``schedstat`` gives the nanoseconds a thread ran and waited runnable for a core, ``stat`` its
nice value) into a JSON-lines file; ``report`` takes the window of ``--window`` seconds in which
the host was busiest and prints, per process and nice value, the share of one core its threads
ran and the share they spent waiting for one. A thread whose wait is several times its run time
gets a core late whenever it wakes: under ``benchmarks/qos.py``'s flood that is what a replica's
step thread (nice 19) sees.

    python scripts/thread_sched.py record /tmp/threads.jsonl 150 &
    python benchmarks/qos.py --quick --modes priority ...
    python scripts/thread_sched.py report /tmp/threads.jsonl [--window 20]

Linux only (procfs with schedstats).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time


def snapshot() -> dict:
    """``{"t": time, "th": {"pid/tid": [process name, command line, thread name, nice, run ns,
    wait ns]}}`` for every thread readable now."""
    threads = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            name = open(f"/proc/{pid}/comm").read().strip()
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:120]
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue                                   # the process ended meanwhile
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                stat = open(f"{base}/stat").read()
                nice = int(stat[stat.rindex(")") + 2:].split()[16])
                run, wait, _ = open(f"{base}/schedstat").read().split()
                thread = open(f"{base}/comm").read().strip()
            except (OSError, ValueError):
                continue
            threads[f"{pid}/{tid}"] = [name, cmd, thread, nice, int(run), int(wait)]
    return {"t": time.time(), "th": threads}


def record(path: str, seconds: float) -> None:
    end = time.time() + seconds
    with open(path, "w") as out:
        while time.time() < end:
            snap = snapshot()
            out.write(json.dumps(snap) + "\n")
            out.flush()
            time.sleep(max(0.0, 1.0 - (time.time() - snap["t"])))


def busiest(snaps: list[dict], window: int) -> tuple[dict, dict]:
    """The two snapshots ``window`` apart between which the threads ran the most."""
    def ran(a: dict, b: dict) -> int:
        return sum(v[4] - a["th"][k][4] for k, v in b["th"].items() if k in a["th"])
    if len(snaps) <= window:
        raise SystemExit(f"{len(snaps)} snapshots: record for longer than --window {window}")
    i = max(range(len(snaps) - window), key=lambda j: ran(snaps[j], snaps[j + window]))
    return snaps[i], snaps[i + window]


def rows(a: dict, b: dict) -> dict[tuple[str, str, int], list[int]]:
    """``{(pid, process, nice): [run ns, wait ns]}`` summed over its threads between ``a`` and
    ``b`` (threads alive in both)."""
    out = collections.defaultdict(lambda: [0, 0])
    for key, (name, cmd, _thread, nice, run, wait) in b["th"].items():
        before = a["th"].get(key)
        if before is None:
            continue
        label = name if name.startswith("ray::") or "python" not in name else cmd[-40:]
        row = out[(key.split("/")[0], label, nice)]
        row[0] += run - before[4]
        row[1] += wait - before[5]
    return out


def report(path: str, window: int, min_share: float) -> None:
    snaps = [json.loads(line) for line in open(path)]
    a, b = busiest(snaps, window)
    seconds = b["t"] - a["t"]
    table = rows(a, b)
    total = sum(run for run, _ in table.values())
    print(f"busiest {seconds:.1f} s: {total / seconds / 1e9:.2f} cores in use")
    print(f"{'pid':>7}  {'process':40s} {'nice':>4}  {'cpu %':>6}  {'wait %':>6}  wait/run")
    for (pid, label, nice), (run, wait) in sorted(table.items(), key=lambda kv: -kv[1][0]):
        share = 100.0 * run / seconds / 1e9
        if share >= min_share:
            print(f"{pid:>7}  {label:40s} {nice:>4}  {share:6.1f}  {100.0 * wait / seconds / 1e9:6.1f}"
                  f"  {wait / max(run, 1):8.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="sample every thread once a second")
    r.add_argument("path")
    r.add_argument("seconds", type=float)
    s = sub.add_parser("report", help="the busiest window, per process and nice value")
    s.add_argument("path")
    s.add_argument("--window", type=int, default=20, help="seconds (snapshots) in the window")
    s.add_argument("--min-share", type=float, default=1.0, help="hide rows under this %% of a core")
    args = p.parse_args(argv)
    if args.command == "record":
        record(args.path, args.seconds)
    else:
        report(args.path, args.window, args.min_share)


if __name__ == "__main__":
    main()
