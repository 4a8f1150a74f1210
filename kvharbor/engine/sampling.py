"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds, one batch per
step.

All rows of a step are sampled together and the chosen ids reach the host in one copy (one
device sync per step). Rows first go through their request's logits processors (penalties,
``logit_bias``, ``min_tokens``: ``logits_processors.py``; most rows have none). Greedy rows take
the argmax. Sampled rows: logits divided by the temperature, min-p drops the tokens whose
probability is below ``min_p`` times the most likely one's (as vLLM), top-k keeps the values >= the k-th largest (ties kept), top-p drops
a token once the probability mass before it (in descending order) reaches ``top_p`` (always
keeping the first), then one token is drawn from the softmax by the exponential race
``argmax(p / E)`` with ``E ~ Exp(1)`` per vocabulary entry (an exact draw from ``p``). A seeded
request draws its ``E`` from its own generator, so its tokens depend on its seed alone, not on
the batch it shares, nor on speculative decoding: a request with drafts has several rows in a
step (its positions, in order), each drawing the next ``E`` of its generator as one-at-a-time
decoding would; the generator's state before each draft's row is kept (``rng_states``) and,
when the step rejects a draft, the engine rewinds the generator to the state before the first
discarded row, so the next step draws what one-at-a-time decoding would.
"""

from __future__ import annotations

import torch

from . import logits_processors
from .host_memory import upload
from .request import Request

_TINY = torch.finfo(torch.float32).tiny


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Pick one token per row of ``logits`` ``[B, V]`` for the matching request."""
    return sample_on_device(logits, requests).tolist()


def sample_on_device(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """:func:`sample` without the copy to the host: the chosen ids ``[B]`` (int64) on the
    logits' device, so a caller can feed them to the next step before reading them."""
    logits = logits_processors.apply(logits.float(), requests)
    sampled = [i for i, r in enumerate(requests) if r.sampling.temperature != 0]
    chosen = logits.argmax(dim=-1)
    if not sampled:
        return chosen
    reqs = [requests[i] for i in sampled]
    rows = upload(sampled, torch.int64, logits.device)
    probs = _filtered_probs(logits.index_select(0, rows), reqs)
    chosen.index_copy_(0, rows, (probs / _exponentials(probs, reqs)).argmax(dim=-1))
    return chosen


def _filtered_probs(x: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Softmax of ``x`` ``[S, V]`` after temperature, min-p, top-k and top-p of each row's
    request."""
    dev, vocab = x.device, x.shape[-1]
    x = x / upload([r.sampling.temperature for r in reqs], torch.float32, dev)[:, None]
    min_ps = [r.sampling.min_p for r in reqs]
    if any(min_ps):
        probs = torch.softmax(x, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * upload(min_ps, torch.float32, dev)[:, None]
        x = x.masked_fill(probs < floor, float("-inf"))
    ks = [r.sampling.top_k if 0 < r.sampling.top_k < vocab else 0 for r in reqs]
    ps = [r.sampling.top_p for r in reqs]
    if not any(ks) and all(p >= 1.0 for p in ps):
        return torch.softmax(x, dim=-1)
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    if any(ks):
        k = upload([k or vocab for k in ks], torch.int64, dev)
        kth = sorted_x.gather(1, (k - 1)[:, None])
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if any(p < 1.0 for p in ps):
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs >= upload(ps, torch.float32, dev)[:, None]
        drop[:, 0] = False               # a top_p below float32's resolution still keeps one
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    x = torch.empty_like(x).scatter_(1, order, sorted_x)
    return torch.softmax(x, dim=-1)


def _exponentials(probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """``Exp(1)`` noise ``[S, V]``: seeded rows from their request's generator, the rest from
    the global generator in one call."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(reqs) if r.sampling.seed is None]
    if len(unseeded) == len(reqs):
        return noise.exponential_().clamp_min_(_TINY)
    if unseeded:
        idx = upload(unseeded, torch.int64, probs.device)
        noise.index_copy_(0, idx, torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_())
    prev = None
    for i, r in enumerate(reqs):
        if r.sampling.seed is not None:
            if r.generator is None:
                r.generator = torch.Generator(device=probs.device).manual_seed(r.sampling.seed)
            if r is prev:           # a draft's row: keep the state before it (see module doc)
                r.rng_states.append(r.generator.get_state())
            else:
                r.rng_states = []
            noise[i].exponential_(generator=r.generator)
            prev = r
    return noise.clamp_min_(_TINY)          # a 0 draw would make 0 / 0 = NaN win the argmax
