"""Greedy tokens from the engine equal transformers' own greedy generate, token for token."""

from __future__ import annotations

import pytest
import torch

from kvharbor import LLM, SamplingParams

from .conftest import NEW_TOKENS, hf_greedy, mixed_prompts

MODELS = ["kvharbor/tiny-llama", "kvharbor/tiny-qwen2", "kvharbor/tiny-mistral"]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def expected(llm: LLM, model: str, oracle_cache: dict) -> list[list[int]]:
    if model not in oracle_cache:
        oracle_cache[model] = hf_greedy(llm.hf_model, mixed_prompts())
    return oracle_cache[model]


def run_and_compare(llm: LLM, model: str, oracle_cache: dict) -> None:
    outs = llm.generate(mixed_prompts(), GREEDY)
    want = expected(llm, model, oracle_cache)
    for i, (out, ref) in enumerate(zip(outs, want)):
        assert out.token_ids == ref, f"prompt {i} (len {len(mixed_prompts()[i])}) diverged"
    llm.check_integrity()


@pytest.mark.parametrize("model", MODELS)
def test_batched_greedy_matches_transformers(model, oracle_cache):
    llm = LLM(model=model, device="cpu", num_kv_blocks=1024)
    run_and_compare(llm, model, oracle_cache)
    # A second pass over the same prompts is served mostly from the prefix cache, same tokens.
    run_and_compare(llm, model, oracle_cache)
    assert llm.stats()["prefix_hit_tokens"] > 0.8 * sum(map(len, mixed_prompts()))


@pytest.mark.parametrize("block_size", [1, 32])
def test_block_sizes(block_size, oracle_cache):
    model = "kvharbor/tiny-llama"
    llm = LLM(model=model, device="cpu", block_size=block_size, num_kv_blocks=16384 // block_size)
    run_and_compare(llm, model, oracle_cache)


@pytest.mark.parametrize("model", ["kvharbor/tiny-llama", "kvharbor/tiny-mistral"])
def test_chunked_prefill(model, oracle_cache):
    llm = LLM(model=model, device="cpu", num_kv_blocks=1024, max_num_batched_tokens=96)
    run_and_compare(llm, model, oracle_cache)


def test_preemption_keeps_tokens_exact(oracle_cache):
    model = "kvharbor/tiny-llama"
    # 16 prompts of up to 340 tokens need ~140 blocks at once; 40 forces preemption.
    llm = LLM(model=model, device="cpu", num_kv_blocks=40, max_num_batched_tokens=256)
    run_and_compare(llm, model, oracle_cache)
    assert llm.stats()["preemptions"] > 0


def test_block_size_16_with_preemption_on_qwen2(oracle_cache):
    """Qwen2 (q/k/v biases, GQA 8/4), 16-token blocks, a cache too small for the batch:
    requests are preempted and recomputed, and every token still equals transformers'."""
    model = "kvharbor/tiny-qwen2"
    llm = LLM(model=model, device="cpu", block_size=16, num_kv_blocks=40, max_num_batched_tokens=256)
    run_and_compare(llm, model, oracle_cache)
    assert llm.stats()["preemptions"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("model", MODELS)
def test_cuda_bf16_greedy_matches_transformers_bf16(model):
    """On a GPU: Triton kernels, bf16 weights and cache, against transformers in bf16."""
    llm = LLM(model=model, device="cuda", dtype="bfloat16", num_kv_blocks=1024)
    assert llm.engine.runner.backend.name == "triton"
    want = hf_greedy(llm.hf_model, mixed_prompts())
    outs = llm.generate(mixed_prompts(), GREEDY)
    for i, (out, ref) in enumerate(zip(outs, want)):
        assert out.token_ids == ref, f"prompt {i} diverged"
    llm.check_integrity()
