"""KV tiers: host offload and reload, swap preemption, sliding-window release, memory stats."""

from __future__ import annotations

import random

import pytest

from kvharbor import LLM, SamplingParams
from kvharbor.actors.prefix_directory import PrefixIndex
from kvharbor.engine.hashing import hash_prompt_blocks
from kvharbor.kernels import KV_CACHE_DTYPES

from .conftest import hf_greedy

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
SWAP_PROMPTS = [(n, 10 + n) for n in (90, 80, 70, 60)]
SWAP_PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_evicted_prefix_comes_back_from_host_memory():
    llm = LLM(device="cpu", num_kv_blocks=40, host_kv_blocks=64)
    prefix, other = _tokens(320, 1), _tokens(590, 2)
    cold = llm.generate([prefix], GREEDY)[0]
    llm.generate([other], GREEDY)                 # needs 38 of 40 blocks: evicts `prefix`
    assert llm.stats()["evictions"] >= 17
    hits_before = llm.stats()["prefix_hit_tokens"]
    warm = llm.generate([prefix], GREEDY)[0]
    stats = llm.stats()
    assert warm.token_ids == cold.token_ids
    assert stats["prefix_hit_tokens"] - hits_before == warm.num_cached_tokens   # host hits count
    assert stats["host_hit_tokens"] >= 16 * 16   # most of the prefix came from host memory
    assert warm.num_cached_tokens == 304          # 19 full blocks: device and host hits
    assert stats["host_blocks_loaded"] * 16 == stats["host_hit_tokens"]
    assert 0 < stats["host_blocks_used"] <= stats["host_blocks_total"] == 64
    llm.check_integrity()


def test_kv_events_name_the_tier_and_share_one_sequence():
    llm = LLM(device="cpu", num_kv_blocks=24, host_kv_blocks=32)
    prompt = _tokens(300, 3)
    llm.generate([prompt], GREEDY)
    llm.generate([_tokens(300, 4)], GREEDY)       # pushes `prompt` out to host memory
    batches = llm.engine.drain_kv_events()
    assert [b.tier for b in batches] == ["host", "device"]
    assert [b.seq_no for b in batches] == [0, 1]
    index = PrefixIndex()
    for b in batches:
        assert index.apply_events("r0", b.seq_no, b.stored, b.removed, tier=b.tier)
    match = index.match(hash_prompt_blocks(prompt, 16, parent=llm.engine.hash_root))["r0"]
    assert match.host_blocks > 0 and match.device_blocks + match.host_blocks == match.blocks
    assert set(llm.engine.host_block_hashes()) <= index.replica_hashes("r0")
    assert llm.engine.drain_kv_events() == []
    index.check_integrity()


@pytest.fixture(scope="module")
def unpreempted() -> list[list[int]]:
    prompts = [_tokens(*p) for p in SWAP_PROMPTS]
    return [o.token_ids for o in LLM(device="cpu", num_kv_blocks=256).generate(prompts, SWAP_PARAMS)]


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_round_trips_exactly(mode, unpreempted):
    prompts = [_tokens(*p) for p in SWAP_PROMPTS]
    # Each request ends near 7 blocks; 4 of them in 16 blocks must take turns.
    llm = LLM(device="cpu", num_kv_blocks=16, host_kv_blocks=64, preemption_mode=mode)
    got = llm.generate(prompts, SWAP_PARAMS)
    stats = llm.stats()
    assert [g.token_ids for g in got] == unpreempted
    assert stats["preemptions"] > 0
    assert stats["swap_outs"] > 0 and stats["swap_ins"] > 0 and stats["host_blocks_loaded"] > 0
    assert stats["host_blocks_swapped"] == 0      # every swap came back
    llm.check_integrity()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_swap_preemption_round_trips_a_quantized_cache_exactly(kv_cache_dtype):
    """One-byte caches (float8 blocks are copied as raw bytes) come back from host memory
    bit for bit: the same tokens as with room for every request, in the same cache dtype."""
    prompts = [_tokens(*p) for p in SWAP_PROMPTS]
    roomy = LLM(device="cpu", num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype).generate(prompts, SWAP_PARAMS)
    llm = LLM(device="cpu", num_kv_blocks=16, host_kv_blocks=64, preemption_mode="swap",
              kv_cache_dtype=kv_cache_dtype)
    got = llm.generate(prompts, SWAP_PARAMS)
    stats = llm.stats()
    assert stats["kv_cache_dtype"] == str(KV_CACHE_DTYPES[kv_cache_dtype]).removeprefix("torch.")
    assert stats["swap_outs"] > 0 and stats["swap_ins"] > 0
    assert [g.token_ids for g in got] == [r.token_ids for r in roomy]
    llm.check_integrity()


def test_swap_without_host_tier_is_a_clear_error():
    with pytest.raises(ValueError, match="host_kv_blocks"):
        LLM(device="cpu", num_kv_blocks=16, preemption_mode="swap")


def test_sliding_window_releases_blocks_with_identical_tokens():
    model, window, bs, new = "kvharbor/tiny-mistral", 64, 16, 8
    prompts = [_tokens(n, 20 + n) for n in (200, 150, 90, 40)]
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm = LLM(model=model, device="cpu", num_kv_blocks=64, max_num_batched_tokens=64)
    want = hf_greedy(llm.hf_model, prompts, new)
    first = llm.generate(prompts, sp)
    # At its last step a request has len + new - 1 tokens computed; blocks wholly before
    # computed - window + 1 are released.
    expect = sum(max(0, (len(p) + new - 1 - window + 1) // bs) for p in prompts)
    assert llm.stats()["sliding_window_freed_blocks"] == expect == 16
    assert llm.stats()["sliding_window"] == window
    again = llm.generate(prompts, sp)             # prefix hits over released (cached) blocks
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == want
    assert llm.stats()["prefix_hit_tokens"] > 0
    llm.check_integrity()


def test_full_attention_model_releases_nothing():
    llm = LLM(device="cpu", num_kv_blocks=64)
    llm.generate([_tokens(200, 5)], GREEDY)
    assert llm.stats()["sliding_window_freed_blocks"] == 0


def test_memory_breakdown_counts_cache_and_weights():
    llm = LLM(device="cpu", num_kv_blocks=32, host_kv_blocks=8)
    mem = llm.stats()["memory_bytes"]
    per_block = llm.stats()["kv_bytes_per_token"] * 16
    assert mem["device"]["kv_cache"] == 33 * per_block        # + the null block
    assert mem["host"]["kv_cache"] == 8 * per_block
    weights = sum(p.numel() * p.element_size() for p in llm.hf_model.parameters())
    assert mem["device"]["model_weights"] >= weights > 0


def test_stats_show_swapped_blocks_while_a_request_is_out():
    prompts = [_tokens(*p) for p in SWAP_PROMPTS]
    llm = LLM(device="cpu", num_kv_blocks=16, host_kv_blocks=64, preemption_mode="swap")
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SWAP_PARAMS)
    seen_out = 0
    while engine.has_unfinished():
        engine.step()
        s = llm.stats()
        if s["swap_outs"] > s["swap_ins"]:             # a request's KV is in host memory now
            assert s["host_blocks_swapped"] > 0 and s["host_blocks_used"] >= s["host_blocks_swapped"]
            seen_out += 1
    assert seen_out > 0 and llm.stats()["host_blocks_swapped"] == 0


def test_a_full_host_tier_drops_its_oldest_blocks_and_counts_them():
    llm = LLM(device="cpu", num_kv_blocks=24, host_kv_blocks=8)
    for seed in range(6):                             # distinct prompts: no host hits
        llm.generate([_tokens(300, 40 + seed)], GREEDY)
    s = llm.stats()
    assert s["host_blocks_used"] == 8 and s["host_blocks_dropped"] > 0
    assert s["host_blocks_dropped"] == s["host_blocks_offloaded"] - s["host_blocks_used"]
    llm.check_integrity()


def test_a_prefix_hit_keeps_its_blocks_in_order_when_the_first_is_only_usable_from_host():
    """A standard request's prefix whose first block sits on the device in the pinned region
    (a premium request of the same cache scope loaded it there, so this class may not read
    it) and whose later blocks sit in the shared region: the hit takes the first block from
    host memory, then the rest from host memory too, since a hit is device blocks *then* host
    blocks. Taking the shared device blocks after a host hit would put them first: the
    request would read its prefix's KV out of order and answer differently."""
    llm = LLM(device="cpu", num_kv_blocks=40, pinned_kv_blocks=4, host_kv_blocks=64)
    e, prompt = llm.engine, _tokens(70, 1)
    cold = llm.generate([prompt], GREEDY)[0]
    llm.generate([_tokens(560, 2)], GREEDY)           # evicts the prompt's 4 blocks to host memory
    llm.generate([prompt[:20]], GREEDY, qos="premium")  # its first block back, in the pinned region
    llm.generate([prompt], GREEDY)                    # the next three back, in the shared region
    hashes = hash_prompt_blocks(prompt, 16, parent=e.hash_root)
    assert [e.kv.pool.lookup(h).region for h in hashes] == ["pinned", "shared", "shared", "shared"]
    assert all(e.kv.host.lookup(h) is not None for h in hashes)
    warm = llm.generate([prompt], GREEDY)[0]
    assert warm.token_ids == cold.token_ids and warm.num_cached_tokens == 64
    llm.check_integrity()
