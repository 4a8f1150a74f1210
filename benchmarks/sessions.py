"""Sessions on vs off: multi-turn chats of one tenant while two other tenants flood the cache.

One engine per mode (what one replica runs), the same workload on both in one run, sessions on
and off, interleaved phase by phase (which mode runs a phase first alternates):

    16 chats x 6 turns of tenant "chat" (a 128-token system prompt of its own per chat; each
    turn adds a 30-token user message and 30 generated tokens to the history), and between
    turns two tenants ("flood-a", "flood-b") send distinct 512-token prompts whose blocks
    total ``--flood`` x the KV capacity per gap (5 gaps: 5x capacity over the run at 1.0).

    round t:  [chat turn t of all 16 chats, at once]  then  [flood: --flood x capacity]

With sessions off, the flood evicts the chats' history (LRU) and turns >= 2 recompute it;
with sessions on, each chat's prompt + output blocks stay referenced between its turns.

Reported per mode: reuse of history tokens by turns >= 2 (cached prompt tokens / previous
turn's prompt + output; the ceiling is the full blocks of the history, the last partial
block is never cached), TTFT p50/p90 of turns >= 2 (wall clock, from add_request to the
first token; the 16 turns of a round arrive together), and flood throughput (flood prompt +
output tokens per second of flood phases). Greedy outputs of every turn and every flood
request must be identical in both modes (reuse must not change an answer); the benchmark
fails otherwise. Goals (issue #14): reuse >= 95%, TTFT p90 on/off <= 0.3, flood throughput
on/off >= 0.9.

    python -m benchmarks.sessions --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import machine, pct, result_name, table, write_json
from kvharbor.config import EngineConfig
from kvharbor.engine.engine import Engine
from kvharbor.engine.request import SamplingParams

BS = 16


def make_engine(args, sessions: bool) -> Engine:
    return Engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=args.blocks, block_size=BS,
                               max_num_batched_tokens=args.budget, session_ttl_s=3600.0,
                               session_max_blocks=args.blocks // 2 if sessions else 0))


def run_batch(engine: Engine, jobs: list[tuple[str, str, list[int], int, str | None]]) -> dict:
    """Add ``jobs`` (rid, tenant, prompt, max_tokens, session) at once; step until all end.
    Returns {rid: (output ids, cached tokens, ttft s)} and the wall time."""
    start = time.perf_counter()
    reqs = {}
    for rid, tenant, prompt, max_tokens, session in jobs:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        reqs[rid] = engine.add_request(rid, prompt, sp, tenant=tenant, cache_salt=f"tenant:{tenant}",
                                       session_id=session)
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
    wall = time.perf_counter() - start
    return {"wall_s": wall, "out": {rid: (list(r.output_token_ids), r.num_cached_tokens, first[rid] - start)
                                    for rid, r in reqs.items()}}


def run_mode(args, seed: int, sessions: bool):
    """The workload on one engine, as a generator that pauses after every phase (a round of
    turns, a flood gap) so that ``run_seed`` can interleave the two modes; its return value
    (``StopIteration.value``) is the mode's result."""
    rng = random.Random(seed)
    engine = make_engine(args, sessions)
    histories = [[rng.randrange(256) for _ in range(args.system)] for _ in range(args.chats)]
    flood_per_gap = int(args.flood * args.blocks * BS // args.flood_len)
    turns, floods, flood_tokens, flood_s = [], {}, 0, 0.0
    for t in range(args.turns):
        jobs = []
        for c in range(args.chats):
            prompt = histories[c] + [rng.randrange(256) for _ in range(args.user)]
            jobs.append((f"chat{c}-t{t}", "chat", prompt, args.output, f"c{c}" if sessions else None))
        res = run_batch(engine, jobs)
        for c, (rid, _, prompt, _, _) in enumerate(jobs):
            out, cached, ttft = res["out"][rid]
            turns.append({"turn": t, "chat": c, "history": len(histories[c]) if t else 0,
                          "cached": cached, "ttft_s": ttft, "out": out})
            histories[c] = prompt + out
        yield
        if t == args.turns - 1:
            break
        jobs = [(f"flood{t}-{i}", "flood-a" if i % 2 else "flood-b",
                 [rng.randrange(256) for _ in range(args.flood_len)], args.flood_out, None)
                for i in range(flood_per_gap)]
        res = run_batch(engine, jobs)
        flood_s += res["wall_s"]
        flood_tokens += sum(len(p) + args.flood_out for _, _, p, _, _ in jobs)
        floods.update({rid: v[0] for rid, v in res["out"].items()})
        yield
    engine.check_integrity()
    later = [x for x in turns if x["turn"] > 0]
    history = sum(x["history"] for x in later)
    ceiling = sum((x["history"] - 1) // BS * BS for x in later)
    return {"reuse": sum(min(x["cached"], x["history"]) for x in later) / history,
            "reuse_ceiling": ceiling / history,
            "ttft_p50_s": pct([x["ttft_s"] for x in later], 50),
            "ttft_p90_s": pct([x["ttft_s"] for x in later], 90),
            "flood_tok_s": flood_tokens / flood_s, "flood_requests": len(floods),
            "flood_demand_x_capacity": flood_tokens and (len(floods) * args.flood_len / BS) / args.blocks,
            "preemptions": engine.stats()["preemptions"], "evictions": engine.stats()["evictions"],
            "session_evictions": engine.stats()["session_evictions"],
            "_outputs": ([x["out"] for x in turns], floods)}


def run_seed(args, seed: int) -> dict:
    """Both modes on the same workload, phase by phase in turn (which mode goes first
    alternates every phase), so a slow spell of a shared machine lands on both modes."""
    modes = {"on": run_mode(args, seed, sessions=True), "off": run_mode(args, seed, sessions=False)}
    done: dict[str, dict] = {}
    phase = seed
    while len(done) < len(modes):
        order = ("on", "off") if phase % 2 == 0 else ("off", "on")
        for mode in order:
            if mode in done:
                continue
            try:
                next(modes[mode])
            except StopIteration as end:
                done[mode] = end.value
        phase += 1
    on, off = done["on"], done["off"]
    same = on.pop("_outputs") == off.pop("_outputs")
    return {"seed": seed, "on": on, "off": off, "outputs_identical": same,
            "ttft_p90_ratio": on["ttft_p90_s"] / off["ttft_p90_s"],
            "flood_throughput_ratio": on["flood_tok_s"] / off["flood_tok_s"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=128, help="system prompt tokens per chat")
    ap.add_argument("--user", type=int, default=30, help="user tokens per turn")
    ap.add_argument("--output", type=int, default=30, help="generated tokens per turn")
    ap.add_argument("--blocks", type=int, default=1024, help="KV blocks (capacity)")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--flood", type=float, default=1.0, help="flood blocks per gap, x capacity")
    ap.add_argument("--flood-len", type=int, default=512)
    ap.add_argument("--flood-out", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (like a replica)")
    ap.add_argument("--name", type=result_name, default="sessions")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine()
    warm = make_engine(args, True)                   # first forward passes are slower: not timed
    run_batch(warm, [("warm", "w", [i % 256 for i in range(300)], 4, None)])
    del warm
    seeds = [run_seed(args, s) for s in args.seeds]
    rows = []
    for r in seeds:
        for mode in ("on", "off"):
            m = r[mode]
            rows.append({"seed": r["seed"], "sessions": mode, "reuse %": 100 * m["reuse"],
                         "ceiling %": 100 * m["reuse_ceiling"], "ttft p50 s": m["ttft_p50_s"],
                         "ttft p90 s": m["ttft_p90_s"], "flood tok/s": m["flood_tok_s"],
                         "p90 on/off": r["ttft_p90_ratio"], "flood on/off": r["flood_throughput_ratio"],
                         "same outputs": r["outputs_identical"]})
    print(table(rows, list(rows[0])))
    info["load_avg_at_end"] = __import__("os").getloadavg()
    path = write_json(args.name, {"machine": info, "args": vars(args), "seeds": seeds})
    print(f"wrote {path}")
    if not all(r["outputs_identical"] for r in seeds):
        raise SystemExit("outputs differ between sessions on and off")


if __name__ == "__main__":
    main()
