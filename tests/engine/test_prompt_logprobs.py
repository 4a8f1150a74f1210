"""vLLM's ``prompt_logprobs``: each prompt token's log-probability given the tokens before it,
and its ``k`` best alternatives, as transformers computes them over the whole prompt at once;
through chunked prefill, next to requests that asked for none, past the prefix cache (whose
hit would skip the positions that score the prompt) and through preemption."""

from __future__ import annotations

import pytest
import torch

from kvharbor import LLM, SamplingParams

from .conftest import random_prompt


def reference(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position ``[len(prompt), V]`` (on the CPU),
    from the engine's own weights (on its device)."""
    ids = torch.tensor([prompt], device=llm.hf_model.device)
    with torch.inference_mode():
        return torch.log_softmax(llm.hf_model(ids).logits[0].float(), dim=-1).cpu()


TOL = 5e-4
"""The engine's kernels and transformers' forward round differently: up to 1.1e-4 apart on an
AVX2-only AMD EPYC (a prompt resumed in chunks after a preemption); a score of the wrong
position or token is off by far more."""


def assert_scores(llm: LLM, prompt: list[int], scored: list, k: int) -> None:
    ref = reference(llm, prompt)
    assert len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        lp = scored[i]
        assert abs(lp.logprob - float(ref[i - 1, prompt[i]])) < TOL, i
        best = ref[i - 1].topk(k)
        assert [t for t, _ in lp.top] == best.indices.tolist(), i
        assert all(abs(v - w) < TOL for (_, v), w in zip(lp.top, best.values.tolist())), i


@pytest.mark.parametrize("model_path", ["kvharbor", "transformers"])
def test_prompt_logprobs_over_chunks_in_a_mixed_batch(model_path):
    llm = LLM(device="cpu", num_kv_blocks=256, max_num_batched_tokens=24, model_path=model_path)
    prompts = [random_prompt(70, seed=1), random_prompt(9, seed=2), random_prompt(33, seed=3), [7]]
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=k)
              for k in (3, None, 0, 1)]
    outs = llm.generate(prompts, params)
    plain = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for prompt, sp, out, ref in zip(prompts, params, outs, plain):
        assert out.token_ids == ref.token_ids              # scoring the prompt changes no token
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_scores(llm, prompt, out.prompt_logprobs, sp.prompt_logprobs)


def test_a_cached_prompt_is_still_scored_and_stays_cached():
    llm = LLM(device="cpu", num_kv_blocks=256)
    prompt = random_prompt(80, seed=4)
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prompt], sp)
    scored = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                   prompt_logprobs=1))[0]
    assert scored.num_cached_tokens == 0
    assert_scores(llm, prompt, scored.prompt_logprobs, 1)
    assert llm.generate([prompt], sp)[0].num_cached_tokens == 64         # 4 full blocks of 16


def test_preempted_requests_score_each_prompt_token_once():
    """Too few blocks: requests are preempted (recompute) mid-way and run their prompts again;
    each prompt token is scored once, as transformers scores it."""
    llm = LLM(device="cpu", num_kv_blocks=24, block_size=8, max_num_batched_tokens=16)
    prompts = [random_prompt(30 + 5 * i, seed=10 + i) for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                prompt_logprobs=2))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_scores(llm, prompt, out.prompt_logprobs, 2)


def test_prompt_logprobs_out_of_range_is_refused():
    llm = LLM(device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        llm.generate(["hi"], SamplingParams(max_tokens=2, prompt_logprobs=21))


def test_a_request_preempted_mid_prompt_recomputes_the_position_that_scores_its_next_token():
    """Preempted after 15 of its 40 prompt tokens (blocks of 8), a request has scored tokens
    0-15; token 16's score comes from position 15's logits, inside the second block. The
    whole prompt is in the prefix cache (a plain request computed it), so on its return the
    request may reuse the first block only: reusing the second would skip position 15, and
    every later score would be one token off."""
    llm = LLM(device="cpu", num_kv_blocks=256, block_size=8, max_num_batched_tokens=15, max_num_seqs=1)
    e, prompt = llm.engine, random_prompt(40, seed=21)
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))   # cached
    scored = e.add_request("scored", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                            prompt_logprobs=1), qos="batch")
    e.step()
    assert scored.num_computed_tokens == 15 and len(scored.prompt_lps) == 16
    e.add_request("premium", random_prompt(10, seed=22), SamplingParams(max_tokens=2, temperature=0,
                                                                        ignore_eos=True), qos="premium")
    outs, resumed = {}, []
    while e.has_unfinished():
        outs.update({o.request_id: o for o in e.step() if o.finished})
        e.check_integrity()
        if scored.num_preemptions and scored.num_computed_tokens and not resumed:
            resumed.append(scored.num_computed_tokens)
    assert scored.num_preemptions == 1
    assert resumed == [8 + 15]                # its return: the first block reused, then a chunk
    assert_scores(llm, prompt, outs["scored"].prompt_logprobs, 1)
