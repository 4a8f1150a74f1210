"""Engine logprobs: the sampled token's and the k best, from the raw log-softmax of the step."""

from __future__ import annotations

import torch

from kvharbor.engine.logprobs import token_logprobs
from kvharbor.engine.request import Request, SamplingParams


def _req(logprobs: int | None, temperature: float = 1.0) -> Request:
    return Request("r", [1, 2], SamplingParams(logprobs=logprobs, temperature=temperature))


def test_rows_that_ask_get_the_log_softmax_and_the_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 5.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    out = token_logprobs(logits, [_req(2), _req(None), _req(0, temperature=0.1)], [1, 2, 3])
    ref = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    assert abs(out[0].logprob - float(ref[0, 1])) < 1e-6
    assert [i for i, _ in out[0].top] == [0, 1] and abs(out[0].top[0][1] - float(ref[0, 0])) < 1e-6
    assert out[2].top == () and abs(out[2].logprob - float(ref[2, 3])) < 1e-6   # temperature not applied



def test_rank_is_the_tokens_place_in_the_whole_vocabulary():
    """vLLM's ``Logprob.rank``: 1 for the most likely token; a tie ranks it after its equals."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 5.0, 0.0],
                           [3.0, 2.0, 1.0, 0.0]])
    out = token_logprobs(logits, [_req(0), _req(1), _req(2), _req(0)], [0, 3, 1, 2])
    assert [lp.rank for lp in out] == [1, 4, 4, 3]

def test_offline_engine_reports_logprobs_per_generated_token():
    from kvharbor import LLM

    llm = LLM(device="cpu", num_kv_blocks=64)
    want = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                       logprobs=3))[0]
    engine = llm.engine
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3))
    engine.add_request("b", [9, 10], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    seen = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out.new_logprobs)
    assert all(lp is None for lp in seen["b"]) and len(seen["a"]) == 4
    for lps in seen["a"]:
        (lp,) = lps
        assert len(lp.top) == 3 and abs(lp.logprob - lp.top[0][1]) < 1e-5      # greedy: the best one
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    # LLM.generate returns every token's logprobs, as vLLM's does, not only the last step's (the
    # same up to float noise: alone here, batched with "b" above, the matmuls round differently)
    stepped = [lps[0] for lps in seen["a"]]
    assert [([i for i, _ in lp.top], lp.rank) for lp in want.logprobs] == [([i for i, _ in lp.top], lp.rank)
                                                                         for lp in stepped]
    assert all(abs(a.logprob - b.logprob) < 1e-4 and all(abs(x[1] - y[1]) < 1e-4 for x, y in zip(a.top, b.top))
               for a, b in zip(want.logprobs, stepped))
    assert [lp.top[0][0] for lp in want.logprobs] == want.token_ids
    assert llm.generate([[9, 10]], SamplingParams(max_tokens=2))[0].logprobs is None
