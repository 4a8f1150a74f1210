"""Sampling controls, stop conditions and the streaming step API."""

from __future__ import annotations

import pickle

import pytest

from kvharbor import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=256)


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    prompts = ["once upon a time"] * 3
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    a, b, c = llm.generate(prompts, params)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    topk = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0.7, top_k=1, seed=3,
                                                ignore_eos=True))[0]
    assert greedy.token_ids == topk.token_ids


def test_tiny_top_p_is_greedy(llm):
    greedy = llm.generate(["xyz"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    nucleus = llm.generate(["xyz"], SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6,
                                                   seed=5, ignore_eos=True))[0]
    assert greedy.token_ids == nucleus.token_ids


def test_max_tokens_and_stop_token_ids(llm):
    base = llm.generate(["hello"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert len(base.token_ids) == 10 and base.finish_reason == "length"
    stop_at = base.token_ids[4]
    first = base.token_ids.index(stop_at)
    stopped = llm.generate(["hello"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                     stop_token_ids=[stop_at]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == base.token_ids[:first + 1]
    # the stop token's text is not part of the answer (vLLM's default), the tokens before it are
    assert stopped.text == llm.tokenizer.decode(base.token_ids[:first], skip_special_tokens=True)
    assert stopped.text != llm.tokenizer.decode(stopped.token_ids, skip_special_tokens=True)


def test_stop_string_truncates_text(llm):
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = llm.generate(["The harbor"], sp)[0]
    text = base.text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    out = llm.generate(["The harbor"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                      stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.find(stop)]
    assert stop not in out.text


def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after_it(llm):
    """vLLM's ``include_stop_str_in_output``: the text ends with the earliest stop string
    (the rest of its token's text is cut), in the final output and in the streamed deltas."""
    sp = dict(max_tokens=24, temperature=0, ignore_eos=True)
    text = llm.generate(["The harbor"], SamplingParams(**sp))[0].text
    early, late = text[3:5], text[12:15]
    assert text.find(early) == 3 and text.find(late) > 3
    kept = SamplingParams(**sp, stop=[late, early], include_stop_str_in_output=True)
    out = llm.generate(["The harbor"], kept)[0]
    assert (out.text, out.finish_reason) == (text[:5], "stop")
    engine, streamed = llm.engine, ""
    engine.add_request("kept-stop", llm.encode("The harbor"), kept)
    while engine.has_unfinished():
        streamed += "".join(o.new_text for o in engine.step())
    assert streamed == text[:5]
    for bad in ("false", None):
        with pytest.raises(ValueError, match="include_stop_str_in_output must be true or false"):
            llm.generate(["The harbor"], SamplingParams(max_tokens=2, include_stop_str_in_output=bad))
    with pytest.raises(ValueError, match="ignore_eos must be true or false"):
        llm.generate(["The harbor"], SamplingParams(max_tokens=2, ignore_eos="false"))


def test_the_earliest_of_several_stop_strings_ends_the_text(llm):
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    text = llm.generate(["The harbor"], sp)[0].text
    early, late = text[3:5], text[12:15]
    assert text.find(early) == 3 and text.find(late) > 3
    out = llm.generate(["The harbor"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                      stop=[late, early]))[0]
    assert out.finish_reason == "stop" and out.text == text[:3]
    # Both complete at the same character (one ends the other): the earlier start wins.
    k = next(i for i in range(3, len(text) - 3)
             if text.find(text[i:i + 3]) == i and text.find(text[i + 1:i + 3]) == i + 1)
    both = llm.generate(["The harbor"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                       stop=[text[k + 1:k + 3], text[k:k + 3]]))[0]
    assert both.text == text[:k]


def test_min_tokens_holds_back_stop_strings_until_reached(llm):
    """A stop string is not looked for before ``min_tokens`` (stop token ids and EOS are masked
    instead: test_logits_processors.py); the tokens themselves are unchanged."""
    base = llm.generate(["hello"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    stop = llm.tokenizer.decode(base.token_ids[1:3])
    early = llm.generate(["hello"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                   stop=[stop]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 3
    held = llm.generate(["hello"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                  stop=[stop], min_tokens=6))[0]
    assert len(held.token_ids) >= 6
    assert held.token_ids == base.token_ids[:len(held.token_ids)]


def test_a_stop_string_completed_before_min_tokens_is_not_cut_later(llm):
    """Only a stop string that ends in the text a token changed counts (vLLM's rule): one
    completed before ``min_tokens`` was streamed and stays, and the request runs on."""
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    base = llm.generate(["The harbor"], sp)[0]
    head = llm.tokenizer.decode(base.token_ids[:4])
    stop = next(head[i:i + 2] for i in range(len(head) - 1)
                if base.text.count(head[i:i + 2]) == 1 and "\ufffd" not in head[i:i + 2])
    engine = llm.engine
    engine.add_request("late", llm.encode("The harbor"),
                       SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop],
                                      min_tokens=8))
    streamed, final = "", None
    while final is None:
        for out in engine.step():
            streamed += out.new_text
            final = out if out.finished else None
    assert final.finish_reason == "length"
    assert final.text == base.text and streamed == base.text


def test_each_streamed_output_keeps_the_ids_of_its_step(llm):
    """``token_ids`` of a step's output are what the request held at that step, read when
    the stream has long moved on; ``num_output_tokens`` counts them without reading them."""
    engine = llm.engine
    engine.add_request("ids", llm.encode("The harbor"),
                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in engine.step() if o.request_id == "ids"]
    copied = pickle.loads(pickle.dumps(outs[2]))     # before anything read its ids
    final = outs[-1].token_ids
    assert len(final) == 12
    assert [o.num_output_tokens for o in outs] == list(range(1, 13))
    assert [o.token_ids for o in outs] == [final[:k] for k in range(1, 13)]
    assert [o.new_token_ids for o in outs] == [[t] for t in final]
    assert copied == outs[2] and copied.token_ids == final[:3]


def test_appending_a_token_does_not_copy_the_output(llm, monkeypatch):
    """A token's bookkeeping allocates about the same at the 3,000th output token as at the
    30th: the output's ids are not sliced into each step's output (8 bytes a token), and stop
    strings are looked for only where the text changed. The text itself is still extended
    by a copy (a byte a character for this model's ASCII text), which the bound allows."""
    import tracemalloc

    from kvharbor.engine import engine as engine_module

    peaks: dict[int, int] = {}
    append = engine_module.Engine._append_token

    def traced(self, req, token, logprobs=None):
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = append(self, req, token, logprobs)
        peaks[req.num_output_tokens] = tracemalloc.get_traced_memory()[1] - before
        return out

    monkeypatch.setattr(engine_module.Engine, "_append_token", traced)
    tracemalloc.start()
    try:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3000, temperature=1.0, seed=7,
                                                       ignore_eos=True, stop=["\x00\x01never"]))[0]
    finally:
        tracemalloc.stop()
    assert len(out.token_ids) == 3000
    early = sorted(peaks[k] for k in range(20, 60))[20]
    late = sorted(peaks[k] for k in range(2960, 3000))[20]
    assert late - early < 4 * 2940, (early, late)


def test_a_stream_never_sends_text_a_stop_string_later_takes_back(llm):
    """Deltas hold back the last len(stop) - 1 characters: streamed text that turned out to
    begin the stop string would otherwise reach the client and then vanish from the answer."""
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    text = llm.generate(["The harbor"], sp)[0].text
    stop = next(text[i:i + 4] for i in range(4, len(text) - 4) if "\ufffd" not in text[i:i + 4])
    engine = llm.engine
    engine.add_request("held", llm.encode("The harbor"),
                       SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))
    streamed, final = "", None
    while final is None:
        for out in engine.step():
            streamed += out.new_text
            final = out if out.finished else None
    assert final.text == text[:text.find(stop)]
    assert streamed == final.text


def test_streamed_deltas_add_up_and_abort_frees_blocks(llm):
    engine = llm.engine
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request("s1", llm.encode("streaming test"), sp)
    engine.add_request("s2", list(range(1, 100)), sp)
    deltas, text = [], ""
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id == "s1":
                deltas += out.new_token_ids
                text += out.new_text
                final = out if out.finished else None
        if engine.requests.get("s2") is not None and engine.requests["s2"].num_computed_tokens:
            assert engine.abort("s2")
    assert deltas == final.token_ids
    assert text == final.text
    assert not engine.has_unfinished()
    assert llm.stats()["blocks_used"] == 0
    engine.check_integrity()


def test_chat_uses_the_chat_template(llm):
    outs = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0))
    assert len(outs) == 1                      # a list, one conversation or many, as vLLM's
    out = outs[0]
    templated = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                  add_generation_prompt=True, tokenize=False)
    assert templated.endswith("<|assistant|>\n")
    assert len(out.prompt_token_ids) == len(templated.encode())


def test_chat_takes_a_list_of_conversations_as_vllms_does(llm):
    """A list of conversations runs together and gives one output each, in order, each what
    that conversation alone gives; a message that is not a role dict is refused by name."""
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "and you?"}]]
    outs = llm.chat(chats, greedy)
    assert [o.token_ids for o in outs] == [llm.chat(c, greedy)[0].token_ids for c in chats]
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids
    for bad in ("hi", [["hi"]], [{"content": "no role"}]):
        with pytest.raises(ValueError, match="messages must be a conversation"):
            llm.chat(bad, greedy)
    assert not llm.engine.has_unfinished()


def test_denormal_top_p_keeps_the_most_likely_token(llm):
    greedy = llm.generate(["edge"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    out = llm.generate(["edge"], SamplingParams(max_tokens=6, temperature=1.0, top_p=5e-324, seed=1,
                                                ignore_eos=True))[0]
    assert out.token_ids == greedy.token_ids


def test_eos_stops_a_request_unless_ignore_eos(llm):
    """A generated end-of-sequence token ends the request ("stop"); with ``ignore_eos`` it
    goes on to max_tokens. (The model's EOS id is set to a token its greedy output has.)"""
    free = llm.generate(["tide"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    k = next(i for i in range(2, 12) if free.token_ids[i] not in free.token_ids[:i])
    engine = llm.engine
    saved, engine.eos_ids = engine.eos_ids, {free.token_ids[k]}
    try:
        stopped = llm.generate(["tide"], SamplingParams(max_tokens=12, temperature=0))[0]
        ignored = llm.generate(["tide"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    finally:
        engine.eos_ids = saved
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:k + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == free.token_ids


def test_every_eos_id_of_a_checkpoints_generation_config_stops(llm, tmp_path):
    """Chat checkpoints list several end ids in generation_config.json (Llama 3: <|eot_id|>
    beside <|end_of_text|>); any of them ends the request, as in transformers and vLLM."""
    free = llm.generate(["tide"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    k = next(i for i in range(2, 12) if free.token_ids[i] not in free.token_ids[:i])
    config = llm.hf_model.generation_config
    saved, config.eos_token_id = config.eos_token_id, [llm.engine.tokenizer.eos_token_id, free.token_ids[k]]
    try:
        llm.hf_model.save_pretrained(tmp_path)
    finally:
        config.eos_token_id = saved
    llm.engine.tokenizer.save_pretrained(tmp_path)
    stopped = LLM(model=str(tmp_path), device="cpu", num_kv_blocks=64).generate(
        ["tide"], SamplingParams(max_tokens=12, temperature=0))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:k + 1]
