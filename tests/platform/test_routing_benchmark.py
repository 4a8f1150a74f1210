"""The routing benchmark sends requests whose block hashes are the replicas' own.

The router matches ``GenerateRequest.block_hashes`` against KV events; hashes from another
chain root (or salt) than the engine's never match, and the benchmark then measures a
KV-aware router that cannot see any cache (seen 2026-11-25: the benchmark hashed from the
zero root after the engine's root became the model identity).
"""

from __future__ import annotations

from benchmarks import routing as bench


def test_benchmark_request_hashes_are_the_engines_stored_hashes():
    from kvharbor.engine.llm import LLM
    from kvharbor.engine.request import SamplingParams
    from kvharbor.engine.tokenizer import byte_tokenizer

    messages = [{"role": "system", "content": "harbor ship cargo " * 30},
                {"role": "user", "content": "where is the tide?"}]
    req = bench.make_request(byte_tokenizer(), messages, 3, "r0", 2)
    assert len(req.block_hashes) >= 8
    llm = LLM(model=bench.MODEL, device="cpu", num_kv_blocks=64)
    llm.generate([req.prompt_token_ids], SamplingParams(max_tokens=1, temperature=0.0),
                 cache_salt=req.cache_salt)
    stored = {h for batch in llm.engine.drain_kv_events() for h in batch.stored}
    assert set(req.block_hashes) <= stored


def test_hit_rate_bound_counts_leading_blocks_any_earlier_prompt_held():
    from kvharbor.engine.hashing import hash_prompt_blocks

    first, other = list(range(100)), list(range(200, 264))
    turn2 = first + list(range(100, 150))               # resends the first prompt: 6 full blocks
    recs = [{"sent": t, "prompt": len(p), "hashes": hash_prompt_blocks(p, 16)}
            for t, p in enumerate([first, other, turn2, other])]
    assert bench.hit_rate_bound(recs) == (0 + 0 + 6 * 16 + 4 * 16) / (100 + 64 + 150 + 64)
    fork = first[:50] + [999] * 40                       # 3 full blocks shared, then diverges
    later = {"sent": 9, "prompt": 90, "hashes": hash_prompt_blocks(fork, 16)}
    assert bench.hit_rate_bound(recs + [later]) == (6 * 16 + 4 * 16 + 3 * 16) / (100 + 64 + 150 + 64 + 90)


def test_ttft_floor_gives_each_request_the_idle_time_of_what_no_router_could_have_cached():
    from kvharbor.engine.hashing import hash_prompt_blocks

    system, other = list(range(40)), list(range(300, 340))
    recs = [{"sent": t, "prompt": len(p), "hashes": hash_prompt_blocks(p, 16)}
            for t, p in enumerate([system + [1] * 8, other, system + [2] * 24, system])]
    # 48 cold tokens; 40 cold; 2 blocks of the first then 32; 2 blocks then 8 (40 = 2 x 16 + 8)
    assert bench.bound_misses(recs) == [(48, 48), (40, 40), (64, 32), (40, 8)]
    idle = {1: 0.010, 16: 0.012, 32: 0.020, 64: 0.040}
    # the longest measured prompt not longer than what the request computes: 32 -> 32, 8 -> 1
    assert bench.ttft_floor(bench.bound_misses(recs), idle) == [0.020, 0.020, 0.020, 0.010]
    assert bench.ttft_floor([(64, 64), (16, 0), (70, 70)], idle) == [0.040, 0.010, 0.040]
    noisy = {**idle, 16: 0.025}                        # 16 tokens timed slower than 32
    assert bench.ttft_floor([(20, 20), (40, 40)], noisy) == [0.020, 0.020]
