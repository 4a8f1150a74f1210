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

    fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.9))
    colors = ["#2a9d8f", "#e9c46a", "#e76f51", "#264653"][:len(names)]
    for ax, (values, title) in zip(axes, panels):
        ax.bar(names, values, color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
