"""Speculative decoding (n-gram drafts): the tokens are those of decoding one at a time, the
drafts really are verified and kept, and they never cost another request its blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor import LLM, SamplingParams
from kvharbor.engine.request import Request
from kvharbor.engine.spec_decode import NgramIndex, NgramProposer
from kvharbor.engine.step_budget import StepCostModel

from .conftest import greedy, hf_greedy, mixed_prompts

ALWAYS = {"num_speculative_tokens": 4, "adaptive": False}      # verify every draft


def looping_prompts(n: int = 6) -> list[list[int]]:
    """Prompts that repeat a phrase (drafts from the start), and unrepetitive ones."""
    phrases = [[72, 101, 108, 108, 111, 32], [40, 41, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
    loops = [phrases[i % 3] * (3 + i) + phrases[i % 3][:i % 4] for i in range(n)]
    return loops + mixed_prompts(n, seed=3)


def drafted(llm: LLM) -> tuple[int, int]:
    s = llm.stats()
    return s["spec_draft_tokens"], s["spec_accepted_tokens"]


def test_ngram_index_drafts_what_followed_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    # Suffix (1 2 3) last occurred at 4..6, followed by 7 5 1 ...
    assert idx.drafts(tokens, 3) == ([7, 5, 1], 3)
    # A shorter match only when no longer one exists: (9 8) never occurred, (8) neither, ...
    assert idx.drafts(tokens + [8], 2) == ([], 0)
    assert idx.drafts(tokens + [8, 5], 2) == ([1, 2], 1)     # (5) occurred at 8, then 1 2
    # Past the end a match continues as it did: a loop of period 2 keeps looping.
    loop = NgramIndex(1, 4)
    assert loop.drafts([4, 6, 4, 6, 4], 5) == ([6, 4, 6, 4, 6], 3)
    assert NgramIndex(2, 4).drafts([1, 2, 3], 4) == ([], 0)
    # The very first token is a match too: (5) at 0, followed by 6 7.
    assert NgramIndex(1, 3).drafts([5, 6, 7, 5], 2) == ([6, 7], 1)


def test_ngram_index_reads_each_token_once_so_a_lookup_costs_the_same_at_any_length():
    """Tokens are indexed as they arrive: a lookup after one more token reads only the new
    n-grams and the suffix, not the whole history again (reads of slices, counted)."""

    class Counted(list):
        reads = 0

        def __getitem__(self, index):
            if isinstance(index, slice):
                Counted.reads += 1
            return super().__getitem__(index)

    idx = NgramIndex(1, 3)
    tokens = Counted(range(2000))
    assert idx.drafts(tokens, 2) == ([], 0)
    assert Counted.reads > 3 * 1990                   # the first call indexes everything
    tokens.append(1000)                               # (1000) occurred before, then 1001 1002
    Counted.reads = 0
    assert idx.drafts(tokens, 2) == ([1001, 1002], 1)
    assert Counted.reads <= 2 * 3                     # 3 new n-grams and up to 3 suffixes


class _Drafted:
    """A running request with 4 drafts from a ``match_len``-token match (what the proposer
    reads of one)."""

    def __init__(self, match_len: int = 4):
        self.spec = NgramIndex(1, 4)
        self.spec.match_len = match_len
        self.spec_token_ids = [1, 2, 3, 4]


def test_adaptive_drafting_keeps_the_drafts_that_pay():
    """A step whose cost is mostly fixed (one stream) verifies every draft; one whose cost is
    all per token (a compute-bound batch) keeps only drafts as likely as the tokens pay."""
    proposer = NgramProposer(4, 1, 4)
    fixed, per_token = StepCostModel(), StepCostModel()
    fixed.coef, per_token.coef = [0.02, 1e-5, 0.0], [0.002, 1e-3, 0.0]
    one = [_Drafted()]
    proposer._keep_paying(one, 1, fixed)
    assert one[0].spec_token_ids == [1, 2, 3, 4]
    batch = [_Drafted() for _ in range(8)]
    proposer._keep_paying(batch, 8, per_token)       # prior 1/2: a draft pays above 0.8
    assert all(r.spec_token_ids == [] for r in batch)
    per_seq = StepCostModel()                        # a decode row's cost learned per sequence:
    per_seq.coef = [0.002, 0.0, 1e-3]                # a draft's row costs as much
    batch = [_Drafted() for _ in range(8)]
    proposer._keep_paying(batch, 8, per_seq)
    assert all(r.spec_token_ids == [] for r in batch)
    proposer._hits[4], proposer._trials[4] = 98.0, 98.0     # drafts of 4-token matches hold
    batch = [_Drafted() for _ in range(8)]
    proposer._keep_paying(batch, 8, per_token)
    assert all(len(r.spec_token_ids) >= 3 for r in batch)


def test_adaptive_drafting_prefers_the_likelier_drafts_of_any_request():
    """Drafts are weighed across the batch, most likely first: a request whose 1-token matches
    have failed keeps none, one whose 4-token matches held keeps its drafts, whichever of the
    two comes first in the running list."""
    proposer = NgramProposer(4, 1, 4)
    proposer._hits[1], proposer._trials[1] = 0.0, 98.0          # alpha 0.01
    proposer._hits[4], proposer._trials[4] = 98.0, 98.0         # alpha 0.99
    cost = StepCostModel()
    cost.coef = [0.002, 1e-3, 0.0]              # a draft pays where it is right > 0.8 of the time
    poor, good = _Drafted(1), _Drafted(4)
    proposer._keep_paying([poor, good], 2, cost)
    assert poor.spec_token_ids == [] and len(good.spec_token_ids) >= 3


@settings(max_examples=300, deadline=None)
@given(hits=st.floats(0, 100), misses=st.floats(0, 100), n=st.integers(1, 64),
       a=st.floats(1e-4, 0.05), b=st.floats(0, 2e-3), c=st.floats(0, 2e-3))
def test_adaptive_drafting_keeps_the_count_with_the_most_tokens_per_second(hits, misses, n, a, b, c):
    """One drafted request among ``n`` decodes: the drafts kept are as many as give the step
    the most expected tokens per second, each draft costing one more decode row."""
    proposer = NgramProposer(4, 1, 4)
    proposer._hits[4], proposer._trials[4] = hits, hits + misses
    cost = StepCostModel()
    cost.coef = [a, b, c]
    req = _Drafted(4)
    proposer._keep_paying([req], n, cost)
    alpha = proposer.acceptance(4)

    def tokens_per_second(k: int) -> float:
        return (n + sum(alpha ** j for j in range(1, k + 1))) / (cost.estimate(n, n) + k * (b + c))

    best = max(tokens_per_second(k) for k in range(5))
    assert tokens_per_second(len(req.spec_token_ids)) == pytest.approx(best, rel=1e-9)


def test_propose_trims_drafts_by_the_step_cost_unless_adaptive_is_off():
    """The engine's call: with its cost model, drafts that do not pay are dropped (a batch
    whose cost is all per token, drafts at the prior's one in two); ``adaptive: false`` or no
    cost model keeps every draft."""
    def batch() -> list[Request]:
        reqs = []
        for i in range(8):
            req = Request(f"r{i}", [5, 6, 7, 8] * 4, SamplingParams(max_tokens=50, temperature=0))
            req.num_computed_tokens = req.num_tokens - 1
            reqs.append(req)
        return reqs

    per_token = StepCostModel()
    per_token.coef = [0.002, 1e-3, 0.0]
    for proposer, cost, kept in [(NgramProposer(4, 1, 4), per_token, 0),
                                 (NgramProposer(4, 1, 4, adaptive=False), per_token, 4),
                                 (NgramProposer(4, 1, 4), None, 4)]:
        reqs = batch()
        proposer.propose(reqs, 1000, cost)
        assert [len(r.spec_token_ids) for r in reqs] == [kept] * 8


def test_a_request_still_prefilling_drafts_nothing():
    """Drafts follow a request's last token: one with prompt tokens left to compute (a chunked
    prefill) drafts none, though its prompt repeats."""
    proposer = NgramProposer(4, 1, 4, adaptive=False)
    req = Request("r", [5, 6, 7, 8] * 4, SamplingParams(max_tokens=50, temperature=0))
    req.num_computed_tokens = 8
    proposer.propose([req], 1000)
    assert req.spec_token_ids == []
    req.num_computed_tokens = req.num_tokens - 1
    proposer.propose([req], 1000)
    assert req.spec_token_ids == [5, 6, 7, 8]


def test_acceptance_counts_rejections_and_forgets_old_verifications():
    """Per match length: decayed accepted drafts over decayed trials (each accepted draft and
    each rejection), one success in two trials as the prior."""
    proposer, req = NgramProposer(4, 1, 4), _Drafted(2)
    assert proposer.acceptance(2) == 0.5
    assert proposer.accept(req, [1, 2, 3], [1, 9, 4, 5]) == 1     # one accepted, then rejected
    assert proposer.acceptance(2) == pytest.approx((1 + 1) / (2 + 2))
    assert proposer.accept(req, [1, 2], [1, 2, 6]) == 2            # all accepted: no rejection
    d = NgramProposer.DECAY
    assert proposer.acceptance(2) == pytest.approx((1 * d + 2 + 1) / (2 * d + 2 + 2))
    assert proposer.acceptance(3) == 0.5                            # other lengths untouched
    assert (proposer.draft_tokens, proposer.accepted_tokens) == (5, 3)


@pytest.mark.parametrize("left_by", ["max_tokens", "max_tokens after 2 outputs", "context"])
def test_drafts_never_reach_past_max_tokens_or_the_context(left_by):
    """A step keeps at most drafts + 1 tokens: with 3 tokens left (by max_tokens, counting the
    tokens generated so far, or by the context), a request drafts at most 2, though it could
    draft 4."""
    proposer = NgramProposer(4, 1, 4, adaptive=False)
    prompt, outputs = [5, 6, 7, 8] * 4, [5, 6] if "outputs" in left_by else []
    max_tokens, max_len = (3 + len(outputs), 100) if left_by != "context" else (50, len(prompt) + 3)
    req = Request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    req.all_token_ids.extend(outputs)
    req.num_computed_tokens = req.num_tokens - 1
    proposer.propose([req], max_len)
    assert req.spec_token_ids == ([7, 8] if outputs else [5, 6])


def test_greedy_tokens_equal_transformers_with_drafts():
    """tiny-llama's drafts are verified against the model: the tokens equal transformers'
    greedy generate, while most of them came from accepted drafts."""
    llm = LLM(model="kvharbor/tiny-llama", num_kv_blocks=1024, speculative_config=ALWAYS)
    prompts = looping_prompts()
    outs = llm.generate(prompts, greedy(24))
    want = hf_greedy(llm.hf_model, prompts, 24)
    for i, (out, ref) in enumerate(zip(outs, want)):
        assert out.token_ids == ref, f"prompt {i} diverged"
    verified, accepted = drafted(llm)
    assert accepted > 0.15 * 24 * len(prompts), (verified, accepted)
    llm.check_integrity()


@pytest.mark.parametrize("model, block_size", [("kvharbor/tiny-qwen2", 16), ("kvharbor/tiny-mistral", 4),
                                               ("kvharbor/tiny-llama", 1)])
def test_greedy_tokens_unchanged_by_drafts(model, block_size):
    """Same tokens with and without drafts: across block boundaries (block size 1 and 4), a
    sliding window (tiny-mistral) and chunked prefill beside verification steps."""
    prompts = looping_prompts()
    outs = {}
    for spec in (None, ALWAYS):
        llm = LLM(model=model, block_size=block_size, num_kv_blocks=8192 // block_size,
                  max_num_batched_tokens=128, speculative_config=spec)
        outs[spec is None] = [o.token_ids for o in llm.generate(prompts, greedy(40))]
        llm.check_integrity()
    assert outs[False] == outs[True]
    assert drafted(llm)[1] > 0


def test_drafted_steps_stop_where_one_token_at_a_time_stops():
    """A stop token, a stop string or max_tokens inside a run of accepted drafts ends the
    output at that token, as decoding one token at a time does; text, finish reasons and the
    streamed deltas agree."""
    prompts = looping_prompts(3)[:3]
    plain = LLM(num_kv_blocks=1024).generate(prompts, greedy(30))
    stop_id = plain[0].token_ids[17]
    stop_str = plain[1].text[20:23]
    params = [SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_id]),
              SamplingParams(max_tokens=30, temperature=0, stop=[stop_str]),
              SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)]
    results = {}
    for spec in (None, ALWAYS):
        llm = LLM(num_kv_blocks=1024, speculative_config=spec)
        results[spec is None] = [(o.token_ids, o.text, o.finish_reason)
                                 for o in llm.generate(prompts, params)]
        if spec:
            assert drafted(llm)[1] > 0
    assert results[False] == results[True]
    assert results[False][0][0][-1] == stop_id and results[False][0][2] == "stop"
    assert len(results[False][2][0]) == 13

    # Streamed: a drafted step delivers several tokens in one output, their text in order.
    llm = LLM(num_kv_blocks=1024, speculative_config=ALWAYS)
    llm.engine.add_request("r", prompts[0], greedy(30))
    tokens, text, widest = [], "", 0
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            tokens += out.new_token_ids
            text += out.new_text
            widest = max(widest, len(out.new_token_ids))
    assert widest > 1
    assert tokens == plain[0].token_ids and text == plain[0].text


def test_sampled_tokens_follow_the_models_distribution():
    """A sampled row keeps a draft exactly when it draws it, so tokens follow the model's
    distribution: how often the second token repeats the n-gram continuation is the same
    with and without drafts (400 requests each). The prompt is ``x y x`` with ``y`` the
    model's greedy continuation of ``x``, so that continuation is likely, not certain. Seeded,
    each position draws what one-at-a-time decoding draws (a rejected draft's draw is undone),
    so the tokens are the same ones."""
    plain = LLM(num_kv_blocks=4096)
    x = plain.encode("def add(a, b):\n    return")
    y = plain.generate([x], greedy(8))[0].token_ids
    prompt = x + y + x
    n = 400
    rates, tokens = {}, {}
    for spec in (None, ALWAYS):
        llm = plain if spec is None else LLM(num_kv_blocks=4096, speculative_config=spec)
        params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
        outs = llm.generate([prompt] * n, params)
        agree = 0
        for out in outs:
            draft, _ = NgramIndex(1, 4).drafts(prompt + out.token_ids[:1], 1)
            agree += bool(draft) and draft[0] == out.token_ids[1]
        rates[spec is None] = agree / n
        tokens[spec is None] = [out.token_ids for out in outs]
        if spec:
            verified, accepted = drafted(llm)
            assert verified >= 2 * n and 0 < accepted < verified, (verified, accepted)
    assert 0.2 < rates[True] < 0.8, rates            # the continuation is likely, not certain
    assert abs(rates[True] - rates[False]) < 0.12, rates
    assert tokens[False] == tokens[True]


def test_requests_whose_logits_depend_on_their_output_draft_nothing():
    """Penalties, min_tokens and structured outputs need each row's state after the drafts
    before it: such requests decode one token per step; a plain one beside them drafts."""
    prompt = looping_prompts(1)[0]
    llm = LLM(num_kv_blocks=1024, speculative_config=ALWAYS)
    llm.generate([prompt] * 3, [SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3),
                                SamplingParams(max_tokens=20, temperature=0, min_tokens=19),
                                SamplingParams(max_tokens=20, temperature=0,
                                               structured_outputs={"regex": "[a-z ]{5,20}"})])
    assert drafted(llm) == (0, 0)
    llm.generate([prompt], greedy(20))
    assert drafted(llm)[1] > 0


def test_logprobs_of_drafted_tokens_equal_one_token_at_a_time():
    """Each drafted token comes with its own logprobs, those of its row."""
    prompts = looping_prompts(2)[:2]
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True)
    got = {}
    for spec in (None, ALWAYS):
        llm = LLM(num_kv_blocks=1024, speculative_config=spec)
        for i, p in enumerate(prompts):
            llm.engine.add_request(str(i), p, params)
        seen = {str(i): ([], []) for i in range(len(prompts))}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                seen[out.request_id][0].extend(out.new_token_ids)
                seen[out.request_id][1].extend(out.new_logprobs)
        got[spec is None] = seen
    assert drafted(llm)[1] > 0
    for rid, (tokens, lps) in got[True].items():
        spec_tokens, spec_lps = got[False][rid]
        assert spec_tokens == tokens and len(spec_lps) == len(lps) == 20
        for x, y in zip(lps, spec_lps):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_drafts_never_take_the_blocks_a_decode_needs():
    """With the cache nearly full, drafts are dropped rather than preempting a request or
    holding a block another running request needs next: no preemption, same tokens."""
    prompts = looping_prompts(4)[:4]
    # Block size 4: 4 prompts of <= 28 tokens + 24 new tokens need <= 13 blocks each at the end.
    plain = LLM(block_size=4, num_kv_blocks=52).generate(prompts, greedy(24))
    llm = LLM(block_size=4, num_kv_blocks=52, speculative_config={"num_speculative_tokens": 8,
                                                                  "adaptive": False})
    outs = llm.generate(prompts, greedy(24))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.stats()["preemptions"] == 0
    assert drafted(llm)[1] > 0
    llm.check_integrity()


def test_a_decode_gets_the_last_free_block_before_anothers_drafts():
    """A (first in line) has drafts that need a new block; B's next token needs one too; one
    block is free: B gets it and A verifies no draft this step, nobody is preempted."""
    llm = LLM(block_size=4, num_kv_blocks=64, speculative_config=ALWAYS)
    eng = llm.engine
    a = eng.add_request("a", [5, 6, 7, 5, 6, 7, 5], greedy(10))      # decodes position 7: block 1
    b = eng.add_request("b", [9, 8, 7, 6, 5, 4, 3, 2], greedy(10))   # decodes position 8: block 2
    eng.step()                                                        # both prompts, first tokens
    a.spec = NgramIndex(1, 4)
    eng.spec.propose = lambda running, *_: [setattr(r, "spec_token_ids", [1, 2, 3, 4] if r is a else [])
                                            for r in running]
    held = eng.pool.allocate(eng.pool.num_free(False) - 1, False)
    outs = {o.request_id: o for o in eng.step()}
    assert eng.scheduler.num_preemptions == 0
    assert set(outs) == {"a", "b"} and len(outs["a"].new_token_ids) == 1
    assert a.spec_token_ids == [] and b.num_computed_tokens == 9
    eng.pool.release(held)
    while eng.has_unfinished():
        eng.step()
    llm.check_integrity()
