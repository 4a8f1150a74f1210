"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from .request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Pick one token per row of ``logits`` ``[B, V]`` for the matching request."""
    logits = logits.float()
    if all(r.sampling.temperature == 0 for r in requests):
        return logits.argmax(dim=-1).tolist()
    out = []
    for row, req in zip(logits, requests):
        out.append(_sample_one(row, req))
    return out


def _sample_one(row: torch.Tensor, req: Request) -> int:
    sp = req.sampling
    if sp.temperature == 0:
        return int(row.argmax())
    row = row / sp.temperature
    if sp.top_k > 0 and sp.top_k < row.numel():
        kth = torch.topk(row, sp.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop tokens once the mass before them already reaches top_p (keep at least one).
        drop = probs.cumsum(-1) - probs >= sp.top_p
        drop[0] = False                  # a top_p below float32's resolution still keeps one
        sorted_logits[drop] = float("-inf")
        row = torch.empty_like(row).scatter_(0, order, sorted_logits)
    probs = torch.softmax(row, dim=-1)
    if sp.seed is not None and req.generator is None:
        req.generator = torch.Generator(device=row.device).manual_seed(sp.seed)
    return int(torch.multinomial(probs, 1, generator=req.generator))
