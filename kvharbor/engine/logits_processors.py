"""The sampling parameters that change a request's logits before a token is picked.

Applied in vLLM's order, to the rows whose request asks for one, greedy rows included:

- ``min_tokens``: until the request has generated that many tokens, its stop token ids and
  (unless ``ignore_eos``) the end-of-sequence ids get ``-inf`` (``Request.held_stops``).
- ``logit_bias``: each named id's bias is added to its logit (OpenAI's semantics).
- ``allowed_token_ids`` and ``bad_words`` (vLLM's): every id but the allowed ones, and the last
  token of a bad word whose other tokens end the output so far, get ``-inf`` (after the bias,
  so no bias lifts them).
- ``repetition_penalty`` (vLLM's, from the CTRL paper): the logit of a token that is in the
  prompt or the output so far is divided by it when positive and multiplied by it otherwise.
- ``frequency_penalty`` and ``presence_penalty``: OpenAI's formula,
  ``logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty`` with
  ``count[j]`` the occurrences of ``j`` in the output so far.

- ``structured_outputs``: last, the tokens the request's grammar forbids get ``-inf``
  (``structured_output.mask``); a token the engine forces (``Request.forced_ids``: the
  ``</think>`` that closes a spent ``thinking_token_budget``) leaves every other at ``-inf``.

``min_p`` acts after temperature, in ``sampling.py``. The rows that need none of this are left
as they are (no copy when no row does). Log-probabilities stay the model's own, read from the
logits before any of this (vLLM's default, ``raw_logprobs``).
"""

from __future__ import annotations

import torch

from . import structured_output
from .host_memory import upload
from .request import Request


def holds_stops(req: Request) -> bool:
    """``min_tokens`` not yet reached: its stop and EOS ids are masked this step."""
    return bool(req.held_stops) and req.num_output_tokens < req.sampling.min_tokens


def depends_on_outputs(req: Request) -> bool:
    """The request's next logits depend on its output so far (so a step launched before the
    previous token reaches the host would process them wrongly)."""
    return (req.sampling.penalized or holds_stops(req) or req.matcher is not None
            or req.grammar_wait is not None or any(len(seq) > 1 for seq in req.bad_words)
            or req.reasoning and req.sampling.thinking_token_budget is not None)


def _processed(req: Request) -> bool:
    return (depends_on_outputs(req) or bool(req.sampling.logit_bias or req.bad_words)
            or req.sampling.allowed_token_ids is not None)


def _banned(req: Request) -> list[int]:
    """The ids ``req`` may not pick this step: ``min_tokens``'s held ids, and each bad word's
    last token where the output so far ends with the word's other tokens (vLLM's rule: the
    prompt is not looked at)."""
    banned = list(req.held_stops) if holds_stops(req) else []
    ids, generated = req.all_token_ids, req.num_output_tokens
    for seq in req.bad_words:
        k = len(seq) - 1
        if k == 0 or k <= generated and tuple(ids[-k:]) == seq[:-1]:
            banned.append(seq[-1])
    return banned


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
    for j, r in enumerate(reqs):
        if r.sampling.allowed_token_ids is not None:
            if r.allowed is None or r.allowed.device != x.device:
                blocked = torch.ones(x.shape[1], dtype=torch.bool)
                blocked[r.sampling.allowed_token_ids] = False
                r.allowed = blocked.to(x.device)
            x[j].masked_fill_(r.allowed, float("-inf"))
    penalized = [j for j, r in enumerate(reqs) if r.sampling.penalized]
    if penalized:
        at = upload(penalized, torch.int64, dev)
        x.index_copy_(0, at, _penalize(x.index_select(0, at), [reqs[j] for j in penalized]))
    constrained = {j: r.matcher for j, r in enumerate(reqs) if r.matcher is not None}
    if constrained:
        structured_output.mask(x, constrained)
    for j, r in enumerate(reqs):
        if r.forced_ids:
            x[j] = torch.where(torch.arange(x.shape[1], device=dev) == r.forced_ids[0], 0.0, float("-inf"))
    return logits.index_copy(0, index, x)


def _add_biases(x: torch.Tensor, reqs: list[Request]) -> None:
    """``logit_bias`` added, then the banned ids (``_banned``) set to ``-inf``: each one sparse
    write over (row, id) pairs."""
    rows, cols, vals, held_rows, held_cols = [], [], [], [], []
    for j, r in enumerate(reqs):
        for token, bias in (r.sampling.logit_bias or {}).items():
            rows.append(j), cols.append(token), vals.append(bias)
        banned = _banned(r)
        held_rows += [j] * len(banned)
        held_cols += banned
    dev = x.device
    if rows:
        x.index_put_((upload(rows, torch.int64, dev), upload(cols, torch.int64, dev)),
                     upload(vals, torch.float32, dev), accumulate=True)
    if held_rows:
        x.index_put_((upload(held_rows, torch.int64, dev), upload(held_cols, torch.int64, dev)),
                     torch.tensor(float("-inf"), device=dev))


def _penalize(x: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """The three penalties of ``reqs`` on their rows ``x`` ``[P, V]``.

    Only the logits of tokens a request has seen change, so the rule runs on those alone:
    each row's candidates are its output ids and, with a repetition penalty, its prompt ids
    (padded with ``V``, an extra column nobody reads); the output counts are one scatter.
    Work grows with the tokens seen, plus two passes over ``[P, V]`` (the counts, the copy)."""
    dev, vocab = x.device, x.shape[1]
    sp = [r.sampling for r in reqs]
    outs = [r.output_token_ids for r in reqs]
    seqs = [(r.prompt_token_ids if s.repetition_penalty != 1 else []) + o for r, s, o in zip(reqs, sp, outs)]
    cand = _padded(seqs, vocab, dev)                                       # [P, L]
    counts = torch.zeros(len(reqs), vocab + 1, device=dev)
    out = _padded(outs, vocab, dev)
    counts.scatter_add_(1, out, torch.ones(out.shape, device=dev))
    c = counts.gather(1, cand)                                             # each candidate's count
    x = torch.cat([x, x.new_zeros(len(reqs), 1)], dim=1)                   # [P, V + 1]
    v = x.gather(1, cand)
    rep, freq, pres = (upload([getattr(s, f) for s in sp], torch.float32, dev)[:, None]
                       for f in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
    v = torch.where(v > 0, v / rep, v * rep) - c * freq - (c > 0).float() * pres
    return x.scatter_(1, cand, v)[:, :vocab]


def _padded(seqs: list[list[int]], pad: int, dev: torch.device) -> torch.Tensor:
    """``seqs`` as one ``[len(seqs), longest]`` int64 tensor, padded with ``pad``."""
    width = max(1, max(map(len, seqs)))
    return upload([s + [pad] * (width - len(s)) for s in seqs], torch.int64, dev)
