"""KV tiers benchmark: the same prefix-heavy workload with and without the host KV tier.

Workload: ``prefixes`` distinct prompt prefixes of ``prefix_tokens`` tokens each, about
``working_set_ratio`` times what the device KV cache holds. Each request is one prefix
(uniformly random, so LRU on the device alone keeps only about a third of them) plus a short
unique suffix, ``max_tokens`` greedy output tokens, ``concurrency`` requests in flight
(closed loop). Every prefix is computed once in a warm-up that is not measured, so every
prefix token computed afterwards is a *recomputed* token.

Both engines run in this process, one after the other, on the same request list:

    device only     host_kv_blocks = 0
    device + host   host_kv_blocks = host_ratio x the working set's blocks

The two engines are stepped alternately, so both see the same machine load, and each keeps
its own clock that runs only inside its ``step()`` calls. Reports TTFT p50 / p90 (ms on that
clock, from ``add_request`` to the first token), prefix tokens recomputed, host hit tokens,
and the ratios. Writes ``benchmarks/results/tiers.json`` and ``tiers.png``. Timings depend
on the machine's load (others may be sharing it): the JSON records the load average before
and after; compare the two rows of one run, not runs.

Run:  python benchmarks/tiers.py            (a few minutes on 2 shared cores)
      python benchmarks/tiers.py --quick    (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvharbor import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class BenchConfig:
    model: str = "kvharbor/tiny-llama"
    device: str = "cpu"
    num_kv_blocks: int = 256
    block_size: int = 16
    prefix_tokens: int = 512
    working_set_ratio: float = 3.0
    host_ratio: float = 1.25
    suffix_tokens: tuple[int, int] = (8, 24)
    max_tokens: int = 4
    requests: int = 96
    concurrency: int = 4
    seed: int = 0

    @property
    def num_prefixes(self) -> int:
        blocks = self.prefix_tokens // self.block_size
        return round(self.working_set_ratio * self.num_kv_blocks / blocks)

    @property
    def host_kv_blocks(self) -> int:
        return int(self.host_ratio * self.num_prefixes * (self.prefix_tokens // self.block_size))


def workload(cfg: BenchConfig) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """(prefixes, measured requests as (prefix index, full prompt))."""
    rng = random.Random(cfg.seed)
    prefixes = [[rng.randrange(256) for _ in range(cfg.prefix_tokens)] for _ in range(cfg.num_prefixes)]
    reqs = []
    for _ in range(cfg.requests):
        i = rng.randrange(cfg.num_prefixes)
        suffix = [rng.randrange(256) for _ in range(rng.randint(*cfg.suffix_tokens))]
        reqs.append((i, prefixes[i] + suffix))
    return prefixes, reqs


class ClosedLoop:
    """Feeds one engine ``concurrency`` requests at a time and times them on its own clock.

    The clock advances only inside this engine's ``step()`` calls, so two loops can be
    stepped alternately (both see the same machine load) and each reports the TTFT it would
    have had running alone: ``ttft = clock at first token - clock at add_request``.
    """

    def __init__(self, llm: LLM, prompts: list[list[int]], concurrency: int, sp: SamplingParams):
        self.engine, self.sp, self.concurrency = llm.engine, sp, concurrency
        self.todo = list(enumerate(prompts))
        self.live: dict[str, tuple[int, float]] = {}
        self.ttft: dict[int, float] = {}
        self.cached: dict[int, int] = {}
        self.clock = 0.0

    @property
    def done(self) -> bool:
        return not self.todo and not self.live

    def tick(self) -> None:
        while self.todo and len(self.live) < self.concurrency:
            i, p = self.todo.pop(0)
            sp = SamplingParams(**{f: getattr(self.sp, f) for f in self.sp.__slots__})
            self.engine.add_request(f"r{i}", p, sp)
            self.live[f"r{i}"] = (i, self.clock)
        t0 = time.perf_counter()
        outs = self.engine.step()
        self.clock += time.perf_counter() - t0
        for out in outs:
            i, start = self.live[out.request_id]
            self.ttft.setdefault(i, self.clock - start)
            if out.finished:
                self.cached[i] = out.num_cached_tokens
                del self.live[out.request_id]


def run_lockstep(loops: list[ClosedLoop]) -> None:
    """Step the loops alternately until all are done."""
    while not all(loop.done for loop in loops):
        for loop in loops:
            if not loop.done:
                loop.tick()


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def make_llm(cfg: BenchConfig, host_blocks: int) -> LLM:
    return LLM(model=cfg.model, device=cfg.device, num_kv_blocks=cfg.num_kv_blocks,
               block_size=cfg.block_size, host_kv_blocks=host_blocks, seed=cfg.seed)


def summarize(cfg: BenchConfig, llm: LLM, loop: ClosedLoop, before: dict) -> dict:
    after = llm.stats()
    ttft_ms = [loop.ttft[i] * 1000 for i in sorted(loop.ttft)]
    recomputed = sum(max(0, cfg.prefix_tokens - c) for c in loop.cached.values())
    return {
        "host_kv_blocks": llm.engine.config.host_kv_blocks,
        "ttft_p50_ms": round(pct(ttft_ms, 50), 2),
        "ttft_p90_ms": round(pct(ttft_ms, 90), 2),
        "ttft_mean_ms": round(statistics.fmean(ttft_ms), 2),
        "prefix_tokens_recomputed": recomputed,
        "prefix_tokens_requested": cfg.prefix_tokens * len(loop.cached),
        "host_hit_tokens": after["host_hit_tokens"] - before["host_hit_tokens"],
        "device_evictions": after["evictions"] - before["evictions"],
        "host_blocks_loaded": after["host_blocks_loaded"] - before["host_blocks_loaded"],
        "engine_busy_s": round(loop.clock, 2),
        "memory_bytes": after["memory_bytes"],
    }


def run_pair(cfg: BenchConfig) -> dict[str, dict]:
    """Both configurations on the same requests, stepped alternately."""
    prefixes, reqs = workload(cfg)
    sp = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
    llms = {"device only": make_llm(cfg, 0), "device + host": make_llm(cfg, cfg.host_kv_blocks)}
    warm = [p + [1] for p in prefixes]            # +1 token: every full prefix block is cached
    run_lockstep([ClosedLoop(llm, warm, cfg.concurrency, sp) for llm in llms.values()])
    before = {name: llm.stats() for name, llm in llms.items()}
    loops = {name: ClosedLoop(llm, [p for _, p in reqs], cfg.concurrency, sp)
             for name, llm in llms.items()}
    run_lockstep(list(loops.values()))
    return {name: summarize(cfg, llms[name], loops[name], before[name]) for name in llms}


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = list(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [rows[n]["ttft_p50_ms"] for n in names], 0.4, label="p50")
    ax1.bar([i + 0.2 for i in x], [rows[n]["ttft_p90_ms"] for n in names], 0.4, label="p90")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("TTFT (ms)")
    ax1.legend()
    ax2.bar(list(x), [rows[n]["prefix_tokens_recomputed"] for n in names], 0.5, color="tab:red")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("prefix tokens recomputed")
    fig.suptitle("KV tiers: working set = 3x device KV capacity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller cache and fewer requests")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (like a replica)")
    ap.add_argument("--out", type=Path, default=RESULTS / "tiers.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = BenchConfig(num_kv_blocks=96, prefix_tokens=256, requests=24) if args.quick else BenchConfig()
    if args.requests:
        cfg.requests = args.requests
    load_before = os.getloadavg()
    rows = run_pair(cfg)
    base, tier = rows["device only"], rows["device + host"]
    ratios = {"recomputed_reduction_x": (round(base["prefix_tokens_recomputed"] /
                                               tier["prefix_tokens_recomputed"], 2)
                                         if tier["prefix_tokens_recomputed"] else None),
              "ttft_p90_speedup_x": round(base["ttft_p90_ms"] / tier["ttft_p90_ms"], 2),
              "ttft_p50_speedup_x": round(base["ttft_p50_ms"] / tier["ttft_p50_ms"], 2)}
    print(f"working set {cfg.num_prefixes} prefixes x {cfg.prefix_tokens} tokens = "
          f"{cfg.num_prefixes * cfg.prefix_tokens // cfg.block_size} blocks; device "
          f"{cfg.num_kv_blocks} blocks; host {cfg.host_kv_blocks} blocks; {cfg.requests} requests")
    print(f"{'config':<15}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'recomputed':>12}"
          f"{'host hits':>11}{'busy s':>9}")
    for name, r in rows.items():
        print(f"{name:<15}{r['ttft_p50_ms']:>13.1f}{r['ttft_p90_ms']:>13.1f}"
              f"{r['prefix_tokens_recomputed']:>12}{r['host_hit_tokens']:>11}{r['engine_busy_s']:>9.1f}")
    print(", ".join(f"{k} = {'inf (none recomputed)' if v is None else v}" for k, v in ratios.items()))
    doc = {"config": {**asdict(cfg), "num_prefixes": cfg.num_prefixes, "host_kv_blocks": cfg.host_kv_blocks},
           "results": rows, "ratios": ratios,
           "machine": {"cpus": os.cpu_count(), "torch_threads": args.threads,
                       "loadavg_before": load_before,
                       "loadavg_after": os.getloadavg(),
                       "note": "shared machine: other engineers' jobs run at the same time"}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
