"""Log-probabilities of sampled tokens (OpenAI's ``logprobs`` / ``top_logprobs``).

The numbers are the model's own: ``log_softmax`` of the raw logits of the step, before
temperature, top-k or top-p (as vLLM reports them by default), in natural log units. For a
request whose ``SamplingParams.logprobs`` is ``k`` (not None), each sampled token gets
``TokenLogprobs(logprob, top, rank)`` with ``top`` the ``k`` most likely ids, most likely
first, and ``rank`` the token's place in the whole vocabulary (vLLM's ``Logprob.rank``: 1 for
the most likely; the count of tokens at least as likely, so a tie ranks it last).
``SamplingParams.prompt_logprobs`` scores the prompt's tokens the same way (vLLM's field):
each one's logprob given the tokens before it (the first has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """The sampled token's log-probability, the ``k`` best ``(token id, logprob)`` and its rank."""

    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int


def scored_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Row ``i`` of ``logits`` ``[N, V]`` scores token ``targets[i]`` with its ``ks[i]`` best
    alternatives and its rank: one ``log_softmax``, one copy to the host (float64 holds the
    float32 logprobs, ranks and ids exactly)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])
    ranks = (lp >= picked).sum(dim=-1, keepdim=True)
    k = max(ks)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    rows = torch.cat([t.double() for t in (picked, ranks, top_v, top_i)], dim=1).cpu().tolist()
    return [TokenLogprobs(row[0], tuple(zip(map(int, row[2 + k:2 + k + want]), row[2:2 + want])), int(row[1]))
            for row, want in zip(rows, ks)]


def token_logprobs(logits: torch.Tensor, requests: list[Request],
                   chosen: list[int]) -> list[TokenLogprobs | None]:
    """One entry per row of ``logits`` ``[B, V]``: None where the request asked for none.

    One ``log_softmax`` over the rows that asked, one copy to the host.
    """
    rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(requests)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    scored = scored_logprobs(logits.index_select(0, index), [chosen[i] for i in rows],
                             [requests[i].sampling.logprobs for i in rows])
    for i, lp in zip(rows, scored):
        out[i] = lp
    return out
