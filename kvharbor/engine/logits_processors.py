"""The sampling parameters that change a request's logits before a token is picked.

Applied in vLLM's order, to the rows whose request asks for one, greedy rows included:

- ``min_tokens``: until the request has generated that many tokens, its stop token ids and
  (unless ``ignore_eos``) the end-of-sequence ids get ``-inf`` (``Request.held_stops``).
- ``logit_bias``: each named id's bias is added to its logit (OpenAI's semantics).
- ``repetition_penalty`` (vLLM's, from the CTRL paper): the logit of a token that is in the
  prompt or the output so far is divided by it when positive and multiplied by it otherwise.
- ``frequency_penalty`` and ``presence_penalty``: OpenAI's formula,
  ``logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty`` with
  ``count[j]`` the occurrences of ``j`` in the output so far.

``min_p`` acts after temperature, in ``sampling.py``. The rows that need none of this are left
as they are (no copy when no row does). Log-probabilities stay the model's own, read from the
logits before any of this (vLLM's default, ``raw_logprobs``).
"""

from __future__ import annotations

import torch

from .host_memory import upload
from .request import Request


def num_output(req: Request) -> int:
    return req.num_tokens - len(req.prompt_token_ids)


def holds_stops(req: Request) -> bool:
    """``min_tokens`` not yet reached: its stop and EOS ids are masked this step."""
    return bool(req.held_stops) and num_output(req) < req.sampling.min_tokens


def depends_on_outputs(req: Request) -> bool:
    """The request's next logits depend on its output so far (so a step launched before the
    previous token reaches the host would process them wrongly)."""
    return req.sampling.penalized or holds_stops(req)


def _processed(req: Request) -> bool:
    return holds_stops(req) or bool(req.sampling.logit_bias) or req.sampling.penalized


def apply(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """``logits`` ``[B, V]`` (float32, one row per request) with each row's processing done:
    the same tensor when no row needs any, else a new one."""
    rows = [i for i, r in enumerate(requests) if _processed(r)]
    if not rows:
        return logits
    dev = logits.device
    index = upload(rows, torch.int64, dev)
    x = logits.index_select(0, index)                                  # [R, V], a copy
    reqs = [requests[i] for i in rows]
    _add_biases(x, reqs)
    penalized = [j for j, r in enumerate(reqs) if r.sampling.penalized]
    if penalized:
        at = upload(penalized, torch.int64, dev)
        x.index_copy_(0, at, _penalize(x.index_select(0, at), [reqs[j] for j in penalized]))
    return logits.index_copy(0, index, x)


def _add_biases(x: torch.Tensor, reqs: list[Request]) -> None:
    """``logit_bias`` added, then ``min_tokens``'s held ids set to ``-inf``: each one sparse
    write over (row, id) pairs."""
    rows, cols, vals, held_rows, held_cols = [], [], [], [], []
    for j, r in enumerate(reqs):
        for token, bias in (r.sampling.logit_bias or {}).items():
            rows.append(j), cols.append(token), vals.append(bias)
        if holds_stops(r):
            held_rows += [j] * len(r.held_stops)
            held_cols += r.held_stops
    dev = x.device
    if rows:
        x.index_put_((upload(rows, torch.int64, dev), upload(cols, torch.int64, dev)),
                     upload(vals, torch.float32, dev), accumulate=True)
    if held_rows:
        x.index_put_((upload(held_rows, torch.int64, dev), upload(held_cols, torch.int64, dev)),
                     torch.tensor(float("-inf"), device=dev))


def _penalize(x: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """The three penalties of ``reqs`` on their rows ``x`` ``[P, V]``."""
    dev, vocab = x.device, x.shape[1]
    counts = _counts([r.output_token_ids for r in reqs], vocab, dev)   # [P, V]
    sp = [r.sampling for r in reqs]
    if any(s.repetition_penalty != 1 for s in sp):
        seen = (counts > 0) | (_counts([r.prompt_token_ids for r in reqs], vocab, dev) > 0)
        rep = upload([s.repetition_penalty for s in sp], torch.float32, dev)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = upload([s.frequency_penalty for s in sp], torch.float32, dev)[:, None]
    pres = upload([s.presence_penalty for s in sp], torch.float32, dev)[:, None]
    return x - counts * freq - (counts > 0).float() * pres


def _counts(seqs: list[list[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """Occurrences ``[len(seqs), vocab]`` (float32) of each id in each sequence."""
    width = max(1, max(map(len, seqs)))
    padded = upload([s + [vocab] * (width - len(s)) for s in seqs], torch.int64, dev)
    counts = torch.zeros(len(seqs), vocab + 1, device=dev)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=dev))
    return counts[:, :vocab]
