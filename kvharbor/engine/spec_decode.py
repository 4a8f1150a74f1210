"""Speculative decoding by prompt lookup: n-gram drafts, verified in the step that computes
the next token (vLLM's ``speculative_config={"method": "ngram", ...}``).

Before each step is scheduled, every running request that decodes proposes up to ``k`` draft
tokens: the tokens that followed the most recent earlier occurrence of its last ``n`` tokens,
in its prompt or its own output, for ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min`` (``NgramIndex``). The step computes the request's last token and its
``d`` drafts as one query of ``d + 1`` tokens (as a prefill chunk is computed) and samples a
token at each of the ``d + 1`` positions, each from the model's distribution given the tokens
before it::

    tokens so far  ... x y z        drafts  [a b c]       query  [z a b c]
    sampled at each position        [a b q r]              (a and b match, c != q)
    kept this step                  [a b q]                (3 tokens for one forward)

Draft ``i`` is accepted while it equals the token sampled at its position; the first sampled
token that differs (or, every draft accepted, the one after the last draft) is kept too. So a
step yields 1 to ``d + 1`` tokens and they are the tokens decoding one at a time would give:
greedy rows take the same argmax; a sampled row draws ``t ~ p``, and a draft ``x`` is kept
exactly when ``t == x`` (probability ``p(x)``), else ``t`` is kept, which follows ``p``
restricted to tokens other than ``x``: the rejection rule of speculative sampling for a draft
distribution that is one-hot at ``x``. The kept tokens follow ``p`` exactly.

The K/V of rejected drafts lands in slots past the request's computed tokens, which the next
steps overwrite; the prefix cache only ever holds full blocks of computed, real tokens.

Not drafted for: requests still prefilling, and requests whose logits depend on their output
so far (penalties, ``min_tokens`` not reached, structured outputs), since each draft's row
would need that state as it is after the drafts before it. Draft tokens never cost another
request its seat: a request whose drafts do not fit in free blocks decodes one token.
"""

from __future__ import annotations

from .logits_processors import depends_on_outputs
from .request import Request


class NgramIndex:
    """Where each n-gram (``lo <= n <= hi``) of a growing token list last occurred with a
    token after it: ``maps[n - lo][ngram]`` is the position of that next token.

    Tokens are indexed once, as they arrive (``extend``): ``hi - lo + 1`` dict writes per
    token, so a lookup costs the same at any length.
    """

    __slots__ = ("lo", "hi", "maps", "length", "match_len")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.maps: list[dict[tuple, int]] = [{} for _ in range(hi - lo + 1)]
        self.length = 0
        self.match_len = 0          # the match behind the latest drafts (NgramProposer sets it)

    def extend(self, tokens: list[int]) -> None:
        """Index ``tokens[self.length:]`` (``tokens`` only ever grows)."""
        lo, hi, maps = self.lo, self.hi, self.maps
        for p in range(max(self.length, 1), len(tokens)):
            for n in range(lo, min(hi, p) + 1):
                maps[n - lo][tuple(tokens[p - n:p])] = p
        self.length = len(tokens)

    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``tokens`` (``lo..hi`` long) seen before, and that suffix's length;
        ([], 0) when none was."""
        self.extend(tokens)
        end = len(tokens)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            p = self.maps[n - self.lo].get(tuple(tokens[end - n:]))
            if p is not None:
                # Past the end of ``tokens`` the match continues as it did (an overlapping copy:
                # a loop of period ``end - p`` goes on looping).
                period = end - p
                return [tokens[p + i % period] for i in range(k)], n
        return [], 0


class NgramProposer:
    """Proposes each running request's drafts before a step, keeps those expected to pay
    (``adaptive``), and counts how many were verified and accepted.

    Adaptive drafting: with ``n`` decodes, a step of cost ``C0 = est(n, n)`` (the scheduler's
    learned ``StepCostModel``, ``a + b * tokens + c * seqs``) yields ``n`` tokens. Draft ``j``
    of a request whose drafts are accepted with chance ``alpha`` adds ``alpha ** j`` expected
    tokens for the cost of one more decode row, ``b + c``: a draft's row reads its whole
    context like a decode does, and that cost is what the model learns as ``c`` (a prompt
    token's, ``b``, is far less). Drafts are taken in decreasing ``alpha ** j`` while each raises
    the expected tokens per second, i.e. while ``alpha ** j > (b + c) * tokens / cost`` of the
    step so far: a single stream (``C0`` >> ``b + c``) verifies nearly every draft; a large,
    compute-bound batch only those likely to be right.

    ``alpha`` depends on how long the n-gram match behind the drafts is (a 4-token match
    predicts far better than a 1-token one): per match length, the accepted drafts over
    trials (each accepted draft and each rejection), with recent verifications weighing most
    (``decay`` per verification of that length) and one success in two trials as the prior,
    so a length that did badly is still tried now and then where drafting is cheap.
    """

    DECAY = 0.995

    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int,
                 adaptive: bool = True) -> None:
        self.k, self.lo, self.hi, self.adaptive = num_speculative_tokens, lookup_min, lookup_max, adaptive
        self.draft_tokens = 0           # drafts verified (computed by a step)
        self.accepted_tokens = 0        # drafts kept
        self._hits = [0.0] * (lookup_max + 1)       # by match length: decayed accepted drafts
        self._trials = [0.0] * (lookup_max + 1)     # and decayed trials

    @classmethod
    def from_config(cls, spec) -> "NgramProposer":
        return cls(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                   spec.adaptive)

    def acceptance(self, match_len: int) -> float:
        """Chance that a draft from a ``match_len``-token match is accepted, given the drafts
        before it were (see class doc)."""
        return (self._hits[match_len] + 1.0) / (self._trials[match_len] + 2.0)

    def propose(self, running: list[Request], max_model_len: int, cost=None) -> None:
        """Set ``spec_token_ids`` of every request in ``running`` ([] where it drafts none);
        ``cost`` (a ``StepCostModel``): keep only the drafts worth verifying."""
        drafted = []
        for req in running:
            req.spec_token_ids = self._drafts(req, max_model_len)
            if req.spec_token_ids:
                drafted.append(req)
        if drafted and self.adaptive and cost is not None:
            self._keep_paying(drafted, len(running), cost)

    def _keep_paying(self, drafted: list[Request], n: int, cost) -> None:
        """Trim drafts to those that raise the step's expected tokens per second."""
        items = []                          # (expected tokens of draft j, request index)
        for i, req in enumerate(drafted):
            alpha, value = self.acceptance(req.spec.match_len), 1.0
            for _ in req.spec_token_ids:
                value *= alpha
                items.append((value, i))
        items.sort(key=lambda t: t[0], reverse=True)
        per_token = cost.coef[1] + cost.coef[2]         # one more decode row
        tokens, seconds = float(n), cost.estimate(n, n)
        keep = [0] * len(drafted)
        for value, i in items:              # each request's drafts come in order j = 1, 2, ...
            if value * seconds <= per_token * tokens:
                break                       # no later (smaller) value pays either
            tokens += value
            seconds += per_token
            keep[i] += 1
        for req, k in zip(drafted, keep):
            del req.spec_token_ids[k:]

    def _drafts(self, req: Request, max_model_len: int) -> list[int]:
        if req.num_computed_tokens != req.num_tokens - 1 or depends_on_outputs(req):
            return []
        # A step keeps at most drafts + 1 tokens: never past max_tokens or the context.
        n_out = req.num_output_tokens
        k = min(self.k, req.sampling.max_tokens - n_out - 1, max_model_len - req.num_tokens - 1)
        if k <= 0:
            return []
        if req.spec is None:
            req.spec = NgramIndex(self.lo, self.hi)
        drafts, req.spec.match_len = req.spec.drafts(req.all_token_ids, k)
        return drafts

    def accept(self, req: Request, drafts: list[int], sampled: list[int]) -> int:
        """How many of ``drafts`` (``req``'s, verified by a step) hold: the length of their
        common prefix with ``sampled`` (the tokens sampled at their positions, one more)."""
        n = 0
        while n < len(drafts) and drafts[n] == sampled[n]:
            n += 1
        rejected = int(n < len(drafts))
        m = req.spec.match_len
        self._hits[m] = self._hits[m] * self.DECAY + n
        self._trials[m] = self._trials[m] * self.DECAY + n + rejected
        self.draft_tokens += len(drafts)
        self.accepted_tokens += n
        return n
