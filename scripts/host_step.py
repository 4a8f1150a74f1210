"""Host time of one engine decode step with the model stubbed out (what a GPU waits for).

64 requests (``--requests``) are prefilled, then the model runner's ``execute`` is replaced by
a stub that returns a token per request at once, so ``Engine.step()`` measures only the host:
scheduling, block bookkeeping, hashing, detokenizing, outputs. ``--graphs`` stubs only the
decode graph's forward instead, so the graphs' input staging and the sampler run too. On a GPU these run while the
GPU idles (the H200 run in docs/benchmarks.md: ~1.0 ms of a 2.99 ms step).

    python scripts/host_step.py [--requests 64] [--steps 200] [--profile] [--graphs [--ahead]]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of 100 steps")
    ap.add_argument("--graphs", action="store_true",
                    help="run the decode graphs' input staging and the sampler too (the graph's "
                         "forward stubbed: it returns fixed logits), as a GPU step does")
    ap.add_argument("--ahead", action="store_true",
                    help="with --graphs: decode steps run ahead (async_scheduling), as on a GPU")
    args = ap.parse_args(argv)
    import torch

    from kvharbor import LLM, SamplingParams

    llm = LLM(device="cpu", num_kv_blocks=8192, max_num_batched_tokens=args.requests * args.prompt)
    engine, runner = llm.engine, llm.engine.runner
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=args.steps + 200, temperature=0.0, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", [rng.randrange(3, 250) for _ in range(args.prompt)], sp)
    engine.step()                                       # every prompt in one prefill step

    if args.graphs:           # the graphs' staging and the sampler run; the forward is stubbed
        from kvharbor.engine.decode_graphs import DecodeGraphs

        runner.graphs = DecodeGraphs(runner, args.requests, engine.max_model_len, capture=False)
        logits = torch.zeros(runner.graphs.max_batch, runner.model.config.vocab_size)
        logits[:, 65] = 1.0
        runner.graphs._forward = lambda b, max_len: logits[:b]
        engine.async_scheduling = args.ahead
    else:
        def stub(batch):
            runner.last_logprobs = [None] * len(batch)
            return [65] * len(batch)

        runner.execute = stub
    for _ in range(20):
        engine.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    print(f"{args.requests} decoding requests: host step p50 {1e3 * statistics.median(times):.3f} ms, "
          f"min {1e3 * min(times):.3f} ms")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
