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
