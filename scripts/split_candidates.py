"""Score split-K launch rules for the decode attention against sweeps already measured.

Reads the H200 sweeps in ``benchmarks/results`` (every split count and key tile timed at each
point, the kernel's decode path on) and compares, at each held-out point, the config a rule
picks with the one the current rule (:func:`kvharbor.kernels.triton_backend.choose_num_splits`
plus :func:`kvharbor.kernels.paged_attention.default_tile`) picks. Two candidates, both
rejected (docs/benchmarks.md, "Fourth GPU session"):

- ``waves3``: the most power-of-2 splits that keep the programs within 3 waves of SMs, and
  128-key tiles at every 16-bit decode;
- ``table``: the fastest config at the nearest point of the ``grid`` sweep (programs and
  context nearest in log2), splits capped by the length bound.

Run:  python scripts/split_candidates.py
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvharbor.kernels.paged_attention import default_tile  # noqa: E402
from kvharbor.kernels.triton_backend import MAX_SPLITS, MIN_KEYS_PER_SPLIT, choose_num_splits  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
SMS = 132                                    # the H200's streaming multiprocessors
SPLITRULE = ("splitrule", "splitrule_hd64", "splitrule_qwen")
"""The points no sweep had when ``waves3`` was written down (it was read off the other two)."""
HELD_OUT = SPLITRULE + ("pipeline", "pipeline_n64", "splits_decodepath")
GRID = ("grid_hd64", "grid_3072", "grid_8192", "grid_20480")


def pow2_floor(x: int) -> int:
    return 1 if x < 2 else 1 << (x.bit_length() - 1)


def sweeps(names):
    """((head dim, q heads, kv heads, batch, context), {(splits, keys): us}, bytes) per point;
    Triton's default pipeline stages only."""
    for name in names:
        data = json.loads((RESULTS / f"kernels_decode_h200_{name}.json").read_text())
        m = data["meta"]
        for r in data["rows"]:
            times = {}
            for key, us in r["sweep_splits_us"].items():
                s, n, _, st = key.split("_")[:4]
                if st in ("std", "st3"):
                    times[(int(s[1:]), int(n[1:]))] = us
            yield (m["head_dim"], m["q_heads"], m["kv_heads"], r["batch"], r["context"]), times, r["bytes"]


def current(hd, kvh, batch, ctx):
    """The shipped rule: the backend's split count and the kernel's decode tile (16-bit cache;
    the tile's key count does not depend on the query-head group, passed as 1)."""
    s = choose_num_splits(batch, batch, kvh, ctx, SMS)
    return s, default_tile(batch, batch, 1, hd, 2, s)[1]


def waves3(hd, kvh, batch, ctx):
    return pow2_floor(min(3 * SMS // (batch * kvh), ctx // MIN_KEYS_PER_SPLIT, MAX_SPLITS)), 128


def make_table():
    best = {(k[0], k[3] * k[2], k[4]): min(t, key=t.get) for k, t, _ in sweeps(GRID)}

    def table(hd, kvh, batch, ctx):
        near = lambda v, grid: min(grid, key=lambda g: (abs(math.log2(v) - math.log2(g)), g))
        progs = near(batch * kvh, sorted({p for h, p, _ in best if h == hd}))
        c = near(ctx, sorted({c for h, _, c in best if h == hd}))
        s, n = best[(hd, progs, c)]
        return min(s, pow2_floor(max(1, ctx // MIN_KEYS_PER_SPLIT))), n
    return table


def score(name, rule, held_out) -> None:
    points = {}
    for key, times, nbytes in sweeps(held_out):
        points.setdefault(key, [{}, nbytes])[0].update(times)
    ratios = []
    print(f"{name}: config and us (% of 4,800 GB/s) at each held-out point, the current rule's beside it")
    for (hd, hq, kvh, b, ctx), (times, nbytes) in sorted(points.items()):
        old, new = current(hd, kvh, b, ctx), rule(hd, kvh, b, ctx)
        t_old, t_new = times.get(old), times.get(new)
        pct = lambda t: f"{t:7.1f} ({100 * nbytes / (t * 1e3) / 4800:4.1f}%)" if t else "   not measured"
        print(f"  hd{hd} {hq}/{kvh} b{b:<3} ctx {ctx:>5}: s{new[0]} n{new[1]} {pct(t_new)} | "
              f"current s{old[0]} n{old[1]} {pct(t_old)} | best {pct(min(times.values()))}")
        if t_old and t_new and old != new:
            ratios.append(t_new / t_old)
    print(f"  differs and both measured at {len(ratios)}: no slower at {sum(r <= 1 for r in ratios)}, "
          f"worst {max(ratios):.3f}x, median {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    score("waves3", waves3, SPLITRULE)
    score("table", make_table(), HELD_OUT)
