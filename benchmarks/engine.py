"""Engine benchmark: kvharbor vs transformers' continuous batching vs sequential generate.

    python benchmarks/engine.py [--requests 64] [--output-tokens 128]

Same model and weights for all (the builtin tiny-llama, CPU, fp32). Three parts:
  1. throughput and TTFT on 64 requests (prompts 64-512 tokens, 128 output tokens);
  2. TTFT with a cached 1024-token prefix vs cold;
  3. KV memory waste of the paged cache vs a contiguous max-length cache on the same workload.
Writes benchmarks/results/engine.json and engine.png.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, bar_panels, machine, median, pct, table, write_json  # noqa: E402
from kvharbor import LLM, SamplingParams  # noqa: E402


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(64, 512))] for _ in range(n)]


def run_kvharbor(llm: LLM, prompts, out_tokens: int) -> dict:
    engine = llm.engine
    sp = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
    waste_samples = []
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p, SamplingParams(**{f: getattr(sp, f) for f in sp.__slots__}))
    arrival = {r.request_id: r.arrival for r in engine.requests.values()}
    first: dict[str, float] = {}
    generated = 0
    while engine.has_unfinished():
        running = engine.scheduler.running
        allocated = sum(len(r.blocks) for r in running) * engine.block_size
        if allocated:
            used = sum(r.num_computed_tokens for r in running)
            waste_samples.append((allocated, used))
        for out in engine.step():
            generated += len(out.new_token_ids)
            first.setdefault(out.request_id, time.monotonic())
    elapsed = time.perf_counter() - start
    ttft = [first[k] - arrival[k] for k in first]
    alloc = sum(a for a, _ in waste_samples)
    used = sum(u for _, u in waste_samples)
    return {"system": "kvharbor", "output_tokens_per_s": generated / elapsed, "elapsed_s": elapsed,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "kv_waste_paged": 1 - used / alloc}


def run_transformers_cb(model, prompts, out_tokens: int) -> dict:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=out_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0,
                           num_blocks=4096, block_size=16)
    previous = model.config._attn_implementation
    model.set_attn_implementation("paged|sdpa")
    try:
        start = time.perf_counter()
        outs = model.generate_batch(inputs=prompts, generation_config=cfg, record_timestamps=True)
        elapsed = time.perf_counter() - start
    finally:
        model.set_attn_implementation(previous)
    generated = sum(len(o.generated_tokens) for o in outs.values())
    ttft = [o.timestamps[0] - o.created_time for o in outs.values() if o.timestamps]
    return {"system": "transformers generate_batch", "output_tokens_per_s": generated / elapsed,
            "elapsed_s": elapsed, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "outputs": {k: o.generated_tokens for k, o in outs.items()}}


class _FirstToken:
    """A generate() streamer that records when the first new token arrives."""

    def __init__(self) -> None:
        self.calls, self.at = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.at is None:       # call 1 is the prompt
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def run_sequential(model, prompts, out_tokens: int) -> dict:
    start = time.perf_counter()
    ttft, generated = [], 0
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            streamer = _FirstToken()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_tokens,
                                 min_new_tokens=out_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, streamer=streamer)
            ttft.append(streamer.at - start)          # every request arrived at `start`
            generated += out.shape[1] - len(p)
    elapsed = time.perf_counter() - start
    return {"system": "transformers generate (sequential)", "output_tokens_per_s": generated / elapsed,
            "elapsed_s": elapsed, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99)}


def prefix_ttft(llm: LLM, trials: int = 5) -> dict:
    """TTFT of a 1024-token-prefix prompt when the prefix is cached vs cold (median of trials)."""
    rng = random.Random(1)
    sp = SamplingParams(max_tokens=1, temperature=0)
    cached, cold = [], []
    for t in range(trials):
        prefix = [rng.randrange(256) for _ in range(1024)]
        tail = lambda: [rng.randrange(256) for _ in range(16)]  # noqa: E731
        t0 = time.perf_counter()
        llm.generate([prefix + tail()], sp)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = llm.generate([prefix + tail()], sp)[0]
        cached.append(time.perf_counter() - t0)
        assert out.num_cached_tokens >= 1024
    return {"ttft_cold_s": median(cold), "ttft_cached_s": median(cached),
            "ratio_cached_over_cold": median(cached) / median(cold)}


def contiguous_waste(prompts, out_tokens: int) -> float:
    """A max-length contiguous cache reserves max(prompt)+out_tokens slots per request."""
    reserve = max(map(len, prompts)) + out_tokens
    used = sum(len(p) + out_tokens for p in prompts)
    return 1 - used / (reserve * len(prompts))


def plot(rows: list[dict], path: Path) -> None:
    names = [r["system"].replace(" (sequential)", "\n(sequential)") for r in rows]
    bar_panels(names, [([r["output_tokens_per_s"] for r in rows], "output tokens/s, 64 requests"),
                       ([r["ttft_p99_s"] for r in rows], "TTFT p99 (s)")], path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--skip-sequential", action="store_true")
    args = ap.parse_args(argv)
    info = machine()
    prompts = workload(args.requests)
    llm = LLM(device="cpu", num_kv_blocks=4096, max_num_batched_tokens=2048, max_num_seqs=128)
    llm.generate([[1] * 32], SamplingParams(max_tokens=2))            # warm-up
    rows = [run_kvharbor(llm, prompts, args.output_tokens)]
    kv_waste = rows[0].pop("kv_waste_paged")
    cb = run_transformers_cb(llm.hf_model, prompts, args.output_tokens)
    cb.pop("outputs")
    rows.append(cb)
    if not args.skip_sequential:
        rows.append(run_sequential(llm.hf_model, prompts, args.output_tokens))
    base = rows[1]["output_tokens_per_s"]
    for r in rows:
        r["speedup_vs_transformers_cb"] = r["output_tokens_per_s"] / base
    prefix = prefix_ttft(LLM(device="cpu", num_kv_blocks=1024))
    waste = {"paged": kv_waste, "contiguous_max_len": contiguous_waste(prompts, args.output_tokens)}
    print(table(rows, ["system", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "elapsed_s",
                       "speedup_vs_transformers_cb"]))
    print(f"\nTTFT with 1024-token prefix: cold {prefix['ttft_cold_s']:.3f}s, cached "
          f"{prefix['ttft_cached_s']:.3f}s, ratio {prefix['ratio_cached_over_cold']:.3f} (goal <= 0.25)")
    print(f"KV waste: paged {waste['paged']:.2%} vs contiguous {waste['contiguous_max_len']:.2%} (goal <= 4%)")
    goals = {"throughput_ge_1.5x_transformers_cb": rows[0]["speedup_vs_transformers_cb"] >= 1.5,
             "cached_ttft_le_0.25x_cold": prefix["ratio_cached_over_cold"] <= 0.25,
             "paged_waste_le_4pct": waste["paged"] <= 0.04}
    print("goals:", goals)
    write_json("engine", {"machine": info, "workload": {"requests": args.requests, "prompt_tokens": "64-512",
                                                         "output_tokens": args.output_tokens,
                                                         "model": "kvharbor/tiny-llama", "dtype": "float32"},
                          "throughput": rows, "prefix_ttft": prefix, "kv_waste": waste, "goals_met": goals})
    plot(rows, RESULTS / "engine.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
