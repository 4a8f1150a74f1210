"""Shared helpers for the benchmarks: percentiles, tables, JSON/PNG output, machine info."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def pct(values, q: float) -> float:
    """q-th percentile (0-100) by linear interpolation; nan for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table of ``rows`` (dicts) over ``columns``."""
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = " | ".join(c.ljust(w) for c, w in zip(columns, widths))
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line, sep] + [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells])


def machine() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "cpu": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_avg_at_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def noise_floor(seconds: float = 2.0, work=None) -> dict:
    """How much the same computation's time varies on this machine right now.

    One fixed piece of work (eight pairs of matrix products shaped like a small model's MLP
    at 64 rows, ~3 ms here) repeated for ``seconds``. On these VMs its p99 was 1.9-2.9x its
    p50 with nothing else running, and the slow repetitions burned CPU time equal to their
    wall time: the cores computed slower (the host), no thread was waiting. A tail latency
    ratio (p99 under load over p99 idle) cannot be read more finely than this floor, so the
    latency benchmarks record it beside their results. ``work`` replaces the fixed work
    (tests). ``slow_cpu_over_wall`` near 1 says the slow repetitions computed slower; near 0,
    that they waited (another thread, preemption, steal)."""
    if work is None:
        import importlib

        importlib.import_module("kvharbor.engine")   # before torch allocates: its huge pages
        import torch

        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 256, generator=g)
        w1, w2 = torch.randn(256, 1024, generator=g), torch.randn(1024, 256, generator=g)

        def work() -> None:
            y = x
            for _ in range(8):
                y = torch.relu(y @ w1) @ w2

    for _ in range(10):
        work()
    wall, cpu = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t, c = time.perf_counter(), time.thread_time()
        work()
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    p50 = pct(wall, 50)
    slow = [i for i, w in enumerate(wall) if w > 1.4 * p50]
    return {"reps": len(wall), "p50_ms": round(1000 * p50, 3), "p99_ms": round(1000 * pct(wall, 99), 3),
            "p99_over_p50": round(pct(wall, 99) / p50, 2),
            "share_over_1_4x_p50": round(len(slow) / len(wall), 4),
            "slow_cpu_over_wall": round(sum(cpu[i] for i in slow) / sum(wall[i] for i in slow), 2)
            if slow else None}


def cpu_model() -> str | None:
    """The CPU's model name and its wider vector units (``/proc/cpuinfo``): these VMs are not
    all the same CPU, and the CPU decides, e.g., which of two matrix products is faster at few
    rows."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]                 # the first core's fields
    except OSError:
        return None
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines()
                                                if ":" in line)}
    name, flags = fields.get("model name", ""), fields.get("flags", "").split()
    units = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(units)})" if name else None


def result_name(value: str) -> str:
    """``argparse`` type of a results name or tag: a plain file stem (``x`` is written as
    ``benchmarks/results/x.json``). A path or a file name is refused when the arguments are
    parsed, not after the run when the results are written."""
    if "/" in value or os.sep in value or value.endswith((".json", ".png")):
        raise argparse.ArgumentTypeError(
            f"{value!r} is a path or a file name; give a name (results go to {RESULTS}/<name>.json)")
    return value


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    return path


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def bar_panels(names: list[str], panels: list[tuple[list[float], str]], path: Path,
               width: float = 11.0) -> None:
    """One bar chart per ``(values, title)`` panel, side by side, saved as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.9), squeeze=False)   # one panel too
    colors = ["#2a9d8f", "#e9c46a", "#e76f51", "#264653"][:len(names)]
    for ax, (values, title) in zip(axes[0], panels):
        ax.bar(names, values, color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
