"""Incremental detokenization equals decoding everything at once; the batched sampler keeps
each row's semantics (greedy rows exact, top-k / top-p filters, per-request seeds)."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvharbor.engine.detokenizer import Detokenizer
from kvharbor.engine.request import Request, SamplingParams
from kvharbor.engine.sampling import sample
from kvharbor.engine.tokenizer import byte_tokenizer


def _metaspace_tokenizer(clean_up: bool = False) -> PreTrainedTokenizerFast:
    """A SentencePiece-style word-level tokenizer: '▁' marks a word start, and decode drops
    the first word's leading space, so a window decoded alone spells it differently.
    ``clean_up``: transformers' clean-up of spaces before punctuation (' .' -> '.')."""
    words = ["<unk>", "<s>", "</s>"] + [f"▁{w}" for w in ("the", "harbor", "kv", "café", "a", ".")] + ["s", "é"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=clean_up)


def _stream(tokenizer, prompt: list[int], output: list[int]) -> tuple[list[str], Request]:
    """Feed ``output`` one token at a time; return each step's ``output_text``."""
    detok = Detokenizer(tokenizer)
    req = Request("r", list(prompt), SamplingParams(max_tokens=len(output)))
    texts = []
    for t in output:
        req.all_token_ids.append(t)
        detok.update(req)
        texts.append(req.output_text)
    return texts, req


@pytest.mark.parametrize("seed", range(5))
def test_incremental_text_equals_a_full_decode_after_every_token(seed):
    """Random bytes (split UTF-8 sequences, invalid bytes) and special tokens mixed in."""
    tok = byte_tokenizer()
    rng = random.Random(seed)
    text = "kv harbor — café ☕ 数据 " * 3
    ids = list(text.encode()) + [rng.randrange(259) for _ in range(60)]
    if seed % 2:
        rng.shuffle(ids)
    texts, _ = _stream(tok, [1, 2, 3], ids)
    for n, got in enumerate(texts, start=1):
        assert got == tok.decode(ids[:n], skip_special_tokens=True), f"after {n} tokens"


@pytest.mark.parametrize("clean_up", [False, True], ids=["rust_decode", "transformers_clean_up"])
def test_incremental_text_with_a_metaspace_tokenizer(clean_up):
    """Without clean-up the detokenizer calls the Rust tokenizer directly; with it, through
    transformers' decode (which removes the space before '.'): both equal a full decode."""
    tok = _metaspace_tokenizer(clean_up)
    ids = [3, 4, 8, 5, 9, 6, 10, 1, 7, 3, 8, 2, 4, 8]
    if clean_up:
        assert "." in tok.decode(ids) and " ." not in tok.decode(ids)
    texts, _ = _stream(tok, [3], ids)
    for n, got in enumerate(texts, start=1):
        assert got == tok.decode(ids[:n], skip_special_tokens=True), f"after {n} tokens"


def test_a_window_that_spells_its_context_differently_falls_back_to_a_full_decode():
    """Some tokenizers spell a token differently once the next one follows (here ids 1, 2
    decode to the ligature "æ", not "a" + "e"): the text is then decoded in full."""

    class Ligature:
        def decode(self, ids, **kw):
            return "".join(" aeb"[i] for i in ids).replace("ae", "æ")

    tok = Ligature()
    ids = [3, 1, 2, 3, 1, 3]
    texts, _ = _stream(tok, [3], ids)
    assert texts == [tok.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    assert texts[-1] == "bæbab"


def test_each_token_decodes_a_short_window_not_the_whole_output():
    """The per-token cost does not grow with the output: count the ids decoded."""
    tok = byte_tokenizer()
    seen = []
    real = tok.decode

    class Counting:
        def decode(self, ids, **kw):
            seen.append(len(ids))
            return real(ids, **kw)

    _stream(Counting(), [65], list(b"abcdefgh" * 40))
    assert max(seen) <= 4, f"decoded windows up to {max(seen)} ids"
    # Characters of 2 and 3 bytes: a window holds the last whole one and the part so far.
    seen.clear()
    _stream(Counting(), [65], list("é€数 ".encode() * 40))
    assert max(seen) <= 6, f"decoded windows up to {max(seen)} ids"


def test_a_delta_never_ends_in_half_a_character():
    """Byte-level tokens: after the first byte of 'é' the text ends in U+FFFD; the stream
    holds it back until the character is whole."""
    tokenizer = byte_tokenizer()
    detok = Detokenizer(tokenizer)
    req = Request("r", [1], SamplingParams(max_tokens=8))
    deltas = []
    for t in tokenizer.encode("aé€b", add_special_tokens=False):
        req.all_token_ids.append(t)
        detok.update(req)
        deltas.append(detok.delta(req, final=False))
    assert "".join(deltas) == "aé€b" and not any("\ufffd" in d for d in deltas), deltas


def test_a_stream_holds_back_what_could_begin_a_stop_string_and_the_last_delta_sends_it():
    """Stops "q" and "xyz": every delta but the last keeps back 2 characters (they could begin
    the longer one); the last sends them, so the deltas join into the whole text, and the
    request is forgotten."""
    tokenizer = byte_tokenizer()
    detok = Detokenizer(tokenizer)
    req = Request("r", [1], SamplingParams(max_tokens=8, stop=["q", "xyz"]))
    deltas = []
    for t in b"harbor":
        req.all_token_ids.append(t)
        detok.update(req)
        deltas.append(detok.delta(req, final=False))
    assert "".join(deltas) == "harb"
    assert detok.delta(req, final=True) == "or" and "r" not in detok._sent


@pytest.mark.parametrize("stop", ["é€", "☕ 数", "a", "r — c", "\ufffd"])
def test_stop_strings_are_found_where_the_text_changed_as_in_a_full_search(stop):
    """``truncate_at_stop`` reads only the text a token changed (and ``len(stop) - 1``
    characters before it), yet stops at the same token and cuts at the same place as a
    search of the whole text: also for a stop that completes when a split character does."""
    tok = byte_tokenizer()
    ids = list("kv harbor — café ☕ 数据 é€ ".encode()) + [0xE2, 0x82, 0x41]
    detok = Detokenizer(tok)
    req = Request("r", [1], SamplingParams(max_tokens=len(ids), stop=[stop]))
    for n, t in enumerate(ids, start=1):
        req.all_token_ids.append(t)
        changed = detok.update(req)
        full = tok.decode(ids[:n], skip_special_tokens=True)
        assert req.output_text == full
        found = detok.truncate_at_stop(req, [stop], changed)
        assert (found == stop) == (stop in full) and (found is None) == (stop not in full), f"after {n} tokens"
        if found:
            assert req.output_text == full[:full.find(stop)]
            return
    pytest.fail(f"{stop!r} never completed")


def test_of_several_stop_strings_the_text_is_cut_at_the_earliest():
    """Stops ["b", "a"] on "xaxb": "a" comes first in the text though listed second; of two
    stops at the same place, the one listed first (vLLM's order); a stop at the very start
    leaves nothing."""
    tok = byte_tokenizer()
    detok = Detokenizer(tok)
    req = Request("r", [1], SamplingParams(max_tokens=8, stop=["b", "a"]))
    req.all_token_ids.extend(b"xaxb")
    detok.update(req)
    assert req.output_text == "xaxb"
    assert detok.truncate_at_stop(req, ["b", "a"], 0) == "a" and req.output_text == "x"
    req = Request("r2", [1], SamplingParams(max_tokens=8, stop=["xa", "xax"], include_stop_str_in_output=True))
    req.output_text = "xaxb"                # two stops at the same place: the one listed first
    assert detok.truncate_at_stop(req, req.sampling.stop, 0) == "xa" and req.output_text == "xa"
    req = Request("r3", [1], SamplingParams(max_tokens=8, stop=["x", "b"]))
    req.output_text = "xaxb"                # a stop at the very start: nothing is answered
    assert detok.truncate_at_stop(req, req.sampling.stop, 0) == "x" and req.output_text == ""


def test_a_re_spelled_window_searches_the_whole_text_for_stops():
    """A ligature re-spells text already there ("a" + "e" -> "æ"): the update reports that
    the text changed from its start, so a stop string inside it is still found."""

    class Ligature:
        def decode(self, ids, **kw):
            return "".join(" aeb"[i] for i in ids).replace("ae", "æ")

    detok = Detokenizer(Ligature())
    req = Request("r", [3], SamplingParams(max_tokens=6, stop=["bæ"]))
    for t in (3, 1):
        req.all_token_ids.append(t)
        assert not detok.truncate_at_stop(req, ["bæ"], detok.update(req))
    req.all_token_ids.append(2)
    changed = detok.update(req)
    assert req.output_text == "bæ"
    assert detok.truncate_at_stop(req, ["bæ"], changed) and req.output_text == ""


def _req(i: int, **kw) -> Request:
    return Request(f"r{i}", [1], SamplingParams(max_tokens=4, **kw))


def test_greedy_rows_take_the_argmax_when_others_sample():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    reqs = [_req(i, temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = sample(logits, reqs)
    assert [out[i] for i in (0, 2, 4)] == logits.argmax(-1)[[0, 2, 4]].tolist()


def test_top_k_and_top_p_keep_only_allowed_tokens():
    """Over many draws a top-k row only yields its k best, a top-p row only its nucleus."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]] * 2)
    reqs = [_req(0, top_k=2), _req(1, top_p=0.7)]
    probs = torch.softmax(logits[1], -1)                # 0.64, 0.23, ...: nucleus = {0, 1}
    assert probs[0] < 0.7 <= probs[0] + probs[1]
    seen = [set(), set()]
    for _ in range(300):
        a, b = sample(logits, reqs)
        seen[0].add(a)
        seen[1].add(b)
    assert seen[0] == {0, 1} and seen[1] == {0, 1}


def test_top_p_keeps_the_smallest_set_that_reaches_it():
    """Four equally likely tokens, top_p 0.5: the nucleus is two tokens (their mass reaches
    0.5 exactly), not three. Probabilities of 0.25 are exact in float32, so the boundary is."""
    logits = torch.zeros(1, 4)
    reqs = [_req(0, top_p=0.5)]
    seen = {sample(logits, reqs)[0] for _ in range(200)}
    assert len(seen) == 2, seen


def test_a_top_p_below_float32s_resolution_keeps_the_most_likely_token():
    """top_p 1e-50 is valid (0 < top_p) but 0 in float32: the most likely token stays, the
    row never samples from an empty (NaN) distribution."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 0.5]])
    assert {sample(logits, [_req(0, top_p=1e-50)])[0] for _ in range(50)} == {1}


def _draws(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """The tokens of one ``sample`` call whose row ``i`` is ``reqs[i]``'s, every row
    ``logits`` ``[1, V]``."""
    return torch.tensor(sample(logits.expand(len(reqs), -1).contiguous(), reqs))


def _frequencies(draws: torch.Tensor, vocab: int = 3) -> torch.Tensor:
    return torch.bincount(draws, minlength=vocab) / len(draws)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_softmax_at_the_temperature(temperature):
    """Exponential-race sampling is an exact draw from ``softmax(logits / T)``: over 20,000
    rows each frequency is within 0.012 (3.4 standard deviations at worst) of its probability.
    A race that multiplied by the noise instead of dividing drew 0.531 for a 0.5 token; logits
    multiplied by T instead of divided drew the flatter distribution of 1 / T."""
    torch.manual_seed(1)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    want = torch.softmax(logits[0] / temperature, -1)
    got = _frequencies(_draws(logits, [_req(i, temperature=temperature) for i in range(20_000)]))
    torch.testing.assert_close(got, want, atol=0.012, rtol=0)


def test_unseeded_rows_beside_a_seeded_one_still_follow_the_softmax():
    """A step with one seeded row draws the other rows' noise apart: they are still exact
    draws (not the argmax, not the seeded row's noise)."""
    torch.manual_seed(3)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    reqs = [_req(0, seed=11)] + [_req(i) for i in range(1, 20_001)]
    got = _frequencies(_draws(logits, reqs)[1:])
    torch.testing.assert_close(got, torch.tensor([0.5, 0.3, 0.2]), atol=0.012, rtol=0)


@pytest.mark.parametrize("seed", [None, 5])
def test_a_zero_exponential_draw_does_not_pick_an_impossible_token(monkeypatch, seed):
    """``Exp(1)`` can return 0.0 in float32; ``p / 0`` is ``inf`` for a possible token and NaN
    for one top-k removed (0 / 0), and NaN would win the argmax. Every draw 0 here: the row
    still picks a token it may pick."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: self.zero_())
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    for _ in range(4):
        assert sample(logits, [_req(0, top_k=2, seed=seed)])[0] in (1, 2)


def test_a_seeded_row_does_not_depend_on_its_batch():
    """Same seed, same tokens, whether the request is alone or beside other rows."""
    torch.manual_seed(2)
    logits = torch.randn(3, 100)
    alone = [sample(logits[1:2], [r])[0] for r in [_req(0, seed=7)] for _ in range(8)]
    r = _req(0, seed=7)
    together = [sample(logits, [_req(1), r, _req(2, temperature=0.0)])[1] for _ in range(8)]
    assert alone == together


def test_a_finished_request_leaves_nothing_in_the_detokenizer():
    """Per-request cursors live only while the request runs (a replica serves millions)."""
    from kvharbor import LLM

    llm = LLM(device="cpu", num_kv_blocks=64)
    llm.generate(["one", "two", "three"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    llm.engine.add_request("gone", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.step()
    llm.engine.abort("gone")
    assert llm.engine.detok._cursors == {} and llm.engine.detok._sent == {}


@pytest.mark.parametrize("include, want", [(False, "the harb"), (True, "the harbor k")])
def test_a_stop_string_inside_the_text_cuts_everything_after_it(include, want):
    """The text a token brought may run past a stop string: it is cut before the earliest
    stop, or right after it with ``include_stop_str_in_output``."""
    detok = Detokenizer(_metaspace_tokenizer())
    req = Request("r", [1], SamplingParams(stop=["kv", "or k"], include_stop_str_in_output=include))
    req.output_text = "the harbor kv café"
    assert detok.truncate_at_stop(req, req.sampling.stop, 0)
    assert req.output_text == want
