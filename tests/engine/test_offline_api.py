"""The rest of vLLM's offline API a script reaches for: each output's prompt text,
``get_tokenizer``, ``SamplingParams.clone`` and ``generate(..., use_tqdm=True)``."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from kvharbor import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=64)


def test_each_output_carries_its_prompts_text_or_none_for_token_ids(llm):
    sp = SamplingParams(max_tokens=2, n=2, seed=1)
    ids = llm.encode("Tides turn")
    outs = llm.generate(["The harbor", {"prompt": "Ships"}, ids, {"prompt_token_ids": ids}], sp)
    assert [o.prompt for o in outs] == ["The harbor", "Ships", None, None]
    assert pickle.loads(pickle.dumps(outs[0])) == outs[0] != pickle.loads(pickle.dumps(outs[1]))
    assert llm.chat([{"role": "user", "content": "hi"}], sp)[0].prompt is None     # templated ids
    assert llm.get_tokenizer() is llm.tokenizer


def test_clone_is_a_deep_copy():
    sp = SamplingParams(stop=["a"], logit_bias={3: 1.0}, allowed_token_ids=[1, 2], seed=4)
    twin = sp.clone()
    assert twin == sp and twin is not sp
    twin.stop.append("b"), twin.logit_bias.update({5: 2.0}), twin.allowed_token_ids.append(9)
    assert (sp.stop, sp.logit_bias, sp.allowed_token_ids) == (["a"], {3: 1.0}, [1, 2])


def test_use_tqdm_shows_a_progress_bar_of_finished_requests(llm, capsys):
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2))
    assert capsys.readouterr().err == ""
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2, n=2), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "6/6" in err


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    ids = llm.encode("The harbor at dawn, where the ships wait for the tide")
    greedy = dict(max_tokens=4, temperature=0, ignore_eos=True)
    cut, tail = llm.generate([ids, ids[-7:]], [SamplingParams(truncate_prompt_tokens=7, **greedy),
                                               SamplingParams(**greedy)])
    assert cut.prompt_token_ids == ids[-7:] and cut.token_ids == tail.token_ids
    assert llm.generate([ids], SamplingParams(truncate_prompt_tokens=len(ids) + 5, **greedy))[0].prompt_token_ids == ids
    context = llm.engine.max_model_len
    long = (ids * (context // len(ids) + 1))[:context + 10]
    assert len(llm.generate([long], SamplingParams(truncate_prompt_tokens=16, **greedy))[0].token_ids) == 4
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
            llm.generate([ids], SamplingParams(truncate_prompt_tokens=bad, **greedy))


def test_chat_can_continue_the_final_message(llm):
    """vLLM's continue_final_message: the prompt ends where the last message's text ends (no
    end of turn, no new assistant turn), so the answer carries on from it."""
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    chat = [{"role": "user", "content": "Tides?"}, {"role": "assistant", "content": "The tide"}]
    out = llm.chat(chat, greedy, add_generation_prompt=False, continue_final_message=True)[0]
    text = "<|user|>\nTides?\n<|assistant|>\nThe tide"
    assert out.prompt_token_ids == llm.encode(text)
    assert out.token_ids == llm.generate(text, greedy)[0].token_ids
    closed = llm.chat(chat, greedy, add_generation_prompt=False)[0]
    assert closed.prompt_token_ids == llm.encode(text + "\n")
    with pytest.raises(ValueError, match="continue_final_message needs add_generation_prompt=False"):
        llm.chat(chat, greedy, continue_final_message=True)


def test_skip_special_tokens_false_keeps_them_in_the_text(llm):
    """The end-of-sequence token, forced and not stopping: left out of the text by default
    (as vLLM), spelt out with skip_special_tokens=False, streamed or not."""
    eos = llm.tokenizer.eos_token_id
    sp = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={eos: 100})
    skipped, kept = llm.generate(["The harbor"] * 2, [SamplingParams(**sp),
                                                    SamplingParams(skip_special_tokens=False, **sp)])
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    assert (skipped.text, kept.text) == ("", llm.tokenizer.eos_token * 3)
    engine = llm.engine
    engine.add_request("special-stream", llm.encode("The harbor"), SamplingParams(skip_special_tokens=False, **sp))
    deltas = []
    while engine.has_unfinished():
        deltas += [o.new_text for o in engine.step()]
    assert "".join(deltas) == kept.text
    with pytest.raises(ValueError, match="skip_special_tokens must be true or false"):
        llm.generate(["hi"], SamplingParams(skip_special_tokens="no"))


def test_enable_prefix_caching_false_computes_every_prompt_in_full():
    """vLLM's enable_prefix_caching: off, a repeated prompt hits nothing (same tokens), and a
    prefix pinned forever no longer counts as free room, so a request that only fit by reading
    it is refused up front instead of waiting for room that never comes."""
    prompt = list(range(40, 80))                                   # 2 full blocks + 8 tokens
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = {}
    for caching in (True, False):
        llm = LLM(device="cpu", num_kv_blocks=8, enable_prefix_caching=caching)
        first, again = llm.generate([prompt], greedy)[0], llm.generate([prompt], greedy)[0]
        outs[caching] = (again.num_cached_tokens, again.token_ids == first.token_ids)
        llm.engine.pin_prefix(prompt[:32], qos="standard")           # 2 blocks held forever
        long = SamplingParams(max_tokens=8 * 16 - 40, temperature=0, ignore_eos=True)   # all 8 blocks
        if caching:
            assert len(llm.generate([prompt], long)[0].token_ids) == 8 * 16 - 40
        else:
            with pytest.raises(ValueError, match="KV blocks but only 6 exist"):
                llm.generate([prompt], long)
    assert outs == {True: (32, True), False: (0, True)}


def test_chat_template_kwargs_reach_the_template(llm):
    """vLLM's chat_template_kwargs: extra variables the chat template reads (here a template
    with a ``thinking`` switch, as Qwen3's enable_thinking); names the template is already given
    are refused."""
    tokenizer = llm.tokenizer
    builtin = tokenizer.chat_template
    tokenizer.chat_template = builtin + "{% if thinking %}<think>{% endif %}"
    try:
        chat = [{"role": "user", "content": "hi"}]
        greedy = SamplingParams(max_tokens=2, temperature=0)
        plain = llm.chat(chat, greedy)[0].prompt_token_ids
        thinking = llm.chat(chat, greedy, chat_template_kwargs={"thinking": True})[0].prompt_token_ids
        assert thinking == plain + llm.encode("<think>")
        for bad in ({"messages": []}, {"add_generation_prompt": False}, {"not a name": 1}):
            with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
                llm.chat(chat, greedy, chat_template_kwargs=bad)
    finally:
        tokenizer.chat_template = builtin


def test_stop_reason_names_the_stop_token_or_string_that_ended_the_output(llm):
    """vLLM's ``CompletionOutput.stop_reason``: the stop token id, or the stop string (the
    earliest in the text when several match); None when max_tokens (or EOS) ended it."""
    greedy = dict(temperature=0, ignore_eos=True, max_tokens=12)
    free = llm.generate(["The harbor"], SamplingParams(**greedy))[0].outputs[0]
    assert free.finish_reason == "length" and free.stop_reason is None
    token = free.token_ids[4]
    by_id = llm.generate(["The harbor"], SamplingParams(**greedy, stop_token_ids=[token]))[0]
    assert by_id.outputs[0].stop_reason == token == by_id.stop_reason and by_id.finish_reason == "stop"
    late, early = free.text[-3:], free.text[2:4]
    by_text = llm.generate(["The harbor"], SamplingParams(**greedy, stop=[late, early]))[0].outputs[0]
    assert (by_text.stop_reason, by_text.text, by_text.finish_reason) == (early, free.text[:free.text.find(early)], "stop")
    kept = llm.generate(["The harbor"], SamplingParams(**greedy, stop=[late], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].stop_reason == late and kept.outputs[0].text.endswith(late)


def test_a_stop_tokens_text_leaves_the_output_unless_include_stop_str_in_output(llm):
    """As vLLM's detokenizer: the text of the token that ended the output (EOS, a stop id) is
    left out, also with special tokens spelt out (``skip_special_tokens`` false), and kept with
    ``include_stop_str_in_output``; EOS's ``stop_reason`` is None, a stop id's the id."""
    eos = llm.tokenizer.eos_token_id
    forced = dict(temperature=0, max_tokens=8, skip_special_tokens=False, logit_bias={eos: 100})
    out = llm.generate("Hello", SamplingParams(**forced))[0].outputs[0]
    assert (list(out.token_ids), out.text, out.finish_reason, out.stop_reason) == ([eos], "", "stop", None)
    kept = llm.generate("Hello", SamplingParams(**forced, include_stop_str_in_output=True))[0].outputs[0]
    assert (kept.text, kept.stop_reason) == (llm.tokenizer.decode([eos]), None)
    named = llm.generate("Hello", SamplingParams(**forced, ignore_eos=True, stop_token_ids=[eos]))[0].outputs[0]
    assert (list(named.token_ids), named.stop_reason) == ([eos], eos)      # EOS as a stop id: named (vLLM's)
    greedy = dict(temperature=0, ignore_eos=True, max_tokens=12)
    ids = llm.generate(["The harbor"], SamplingParams(**greedy))[0].outputs[0].token_ids
    i = next(i for i in range(1, 12) if ids[i] not in ids[:i])
    cut, with_stop = (llm.generate(["The harbor"], SamplingParams(**greedy, stop_token_ids=[ids[i]],
                                                                  include_stop_str_in_output=keep))[0].outputs[0]
                      for keep in (False, True))
    assert list(cut.token_ids) == list(with_stop.token_ids) == list(ids[:i + 1])
    assert with_stop.text == cut.text + llm.tokenizer.decode([ids[i]]) and with_stop.stop_reason == ids[i]


def test_a_generation_configs_other_eos_ids_stop_as_vllms_stop_token_ids(tmp_path):
    """A checkpoint whose generation_config lists EOS ids besides the tokenizer's (Qwen2.5 and
    Llama 3 ship such lists): vLLM makes them stop ids, so an output they end reports the id as
    ``stop_reason`` and leaves its text out; ``ignore_eos`` lets the output run past them."""
    from tests.engine.test_other_architectures import ARCHITECTURES, save_checkpoint

    checkpoint = save_checkpoint(ARCHITECTURES["qwen3"], tmp_path / "qwen3")
    greedy = dict(temperature=0, max_tokens=12)
    free = LLM(model=checkpoint, device="cpu", num_kv_blocks=64).generate("Hello", SamplingParams(**greedy))[0]
    ids = list(free.outputs[0].token_ids)
    i = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    config = Path(checkpoint) / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token_id": [258, ids[i]]}))
    llm = LLM(model=checkpoint, device="cpu", num_kv_blocks=64)
    out = llm.generate("Hello", SamplingParams(**greedy))[0].outputs[0]
    assert (list(out.token_ids), out.finish_reason, out.stop_reason) == (ids[:i + 1], "stop", ids[i])
    assert out.text == llm.tokenizer.decode(ids[:i])
    assert list(llm.generate("Hello", SamplingParams(**greedy, ignore_eos=True))[0].outputs[0].token_ids) == ids
