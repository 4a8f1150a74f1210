"""Arguments a user can get wrong raise ValueError naming the fix."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from kvharbor import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=64, max_model_len=512)


def test_max_tokens_zero(llm):
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        llm.generate(["hi"], SamplingParams(max_tokens=0))


def test_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match=r"exceeds the model's context of 512 tokens"):
        llm.generate([[1] * 600], SamplingParams(max_tokens=4))


def test_request_larger_than_cache():
    small = LLM(device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="needs 32 KV blocks but only 16 exist.*raise num_kv_blocks"):
        small.generate([[1] * 500], SamplingParams(max_tokens=12))


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown builtin model 'kvharbor/nope'.*tiny-llama"):
        LLM(model="kvharbor/nope", device="cpu")


def test_missing_local_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="cannot load model"):
        LLM(model=str(tmp_path / "missing"), device="cpu")


def test_unknown_qos_and_bad_sampling(llm):
    with pytest.raises(ValueError, match="unknown QoS class 'gold'"):
        llm.generate(["hi"], SamplingParams(max_tokens=2), qos="gold")
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["hi"], SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["hi"], SamplingParams(temperature=-1))


def test_bad_engine_options():
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(device="cpu", attention_backend="cudnn")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(device="cpu", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="pinned_kv_blocks"):
        LLM(device="cpu", num_kv_blocks=8, pinned_kv_blocks=9)
    # torch's own errors came later: RuntimeError "Expected one of cpu, cuda, ...", and on a
    # CPU-only torch an AssertionError "Torch not compiled with CUDA enabled"
    with pytest.raises(ValueError, match="max_model_len=4097 exceeds the model's context of 4096 tokens"):
        LLM(device="cpu", max_model_len=4097)             # was cut to 4096 without a word
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got 'tpu'"):
        LLM(device="tpu")
    with pytest.raises(ValueError, match=r"device 'cuda:64': this machine's torch sees \d+ CUDA device"):
        LLM(device="cuda:64")


def test_prompt_and_max_tokens_may_fill_the_context_exactly(llm):
    """prompt + max_tokens == max_model_len is served; one token more is refused."""
    out = llm.generate([[1] * 508], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="509 tokens.*= 513 exceeds the model's context of 512"):
        llm.generate([[1] * 509], SamplingParams(max_tokens=4))


def test_empty_prompts_and_reused_request_ids_are_refused(llm):
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    engine = llm.engine
    engine.add_request("same-id", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="'same-id' is already in use"):
        engine.add_request("same-id", [4, 5, 6], SamplingParams(max_tokens=2))
    before = engine.stats()["requests_aborted"]
    assert engine.abort("same-id") and not engine.abort("same-id")
    assert engine.stats()["requests_aborted"] == before + 1 and not engine.has_unfinished()


def test_one_token_id_prompt_is_one_prompt_and_params_must_match_the_prompts(llm):
    outs = llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(outs) == 1 and outs[0].prompt_token_ids == [5, 6, 7, 8]
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2)])


def test_generate_leaves_the_callers_sampling_params_as_they_were(llm):
    """The engine normalises each request's params (a tiny temperature is greedy, a stop
    string becomes a list): on its own copy, not the caller's object."""
    params = SamplingParams(max_tokens=2, temperature=1e-7, stop="zz")
    llm.generate(["hi", "ho"], params)
    assert params.temperature == 1e-7 and params.stop == "zz"


def test_a_temperature_too_small_to_sample_with_is_greedy(llm):
    """Below 1e-5 a temperature is greedy: far below, logits / temperature overflow to inf."""
    greedy = llm.generate(["Once upon"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tiny = llm.generate(["Once upon"], SamplingParams(max_tokens=8, temperature=1e-40, seed=3,
                                                      ignore_eos=True))
    assert tiny[0].token_ids == greedy[0].token_ids


@pytest.mark.parametrize("field,value,words", [
    ("seed", 2**63, "seed must fit in a signed 64-bit integer"),
    ("seed", -2**63 - 1, "seed must fit in a signed 64-bit integer"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("top_k", -1, "top_k must be >= 0"),
    ("logprobs", 21, "logprobs must be an integer in [0, 20]"),
    ("logprobs", -1, "logprobs must be an integer in [0, 20]"),
    ("max_tokens", 2.5, "max_tokens must be an integer >= 1"),
    ("max_tokens", None, "max_tokens must be an integer >= 1"),
    ("temperature", math.nan, "temperature must be a finite number >= 0"),
    ("temperature", math.inf, "temperature must be a finite number >= 0"),
    ("temperature", "0.5", "temperature must be a number"),
    ("presence_penalty", "1", "presence_penalty must be a number"),
    ("seed", 1.5, "seed must be an integer"),
    ("top_k", 2.5, "top_k must be an integer >= 0"),
    ("stop", [5], "stop must be a string or a list of strings"),
    ("stop_token_ids", ["a"], "stop_token_ids must be an integer"),
    ("logit_bias", [1, 2], "logit_bias maps token ids to numbers"),
    ("logit_bias", {2.5: 100}, "logit_bias maps token ids to numbers"),
    ("logit_bias", {"2.5": 100}, "logit_bias maps token ids to numbers"),
    ("logprobs", 1.0, "logprobs must be an integer in [0, 20]"),
    ("n", 0, "n must be an integer in [1, 256]"),
    ("n", 257, "n must be an integer in [1, 256]"),
    ("n", 2.0, "n must be an integer in [1, 256]"),
])
def test_sampling_params_out_of_range_are_refused_naming_the_field(llm, field, value, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate(["hi"], SamplingParams(**{"max_tokens": 2, field: value}))
    assert not llm.engine.has_unfinished()


def test_one_refused_prompt_refuses_the_whole_call_and_leaves_none_of_it_queued(llm):
    """As vLLM's ``LLM.generate``: the prompts added before the bad one are aborted, not left
    to run (and take KV blocks) inside later calls whose outputs never include them."""
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([[3, 4, 5], [6, 7, 8], [9, 10**6]], sp)
    assert not llm.engine.has_unfinished()
    generated = llm.stats()["generated_tokens"]
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2, temperature=0))
    assert llm.stats()["generated_tokens"] == generated + 2


def test_a_refused_request_leaves_the_engine_serving_and_numpy_integers_are_integers(llm):
    """A float seed or a stop list of numbers was queued, then failed every later step: the
    engine served nothing more. A numpy integer is an integer (seed, top_k); no stop is []."""
    greedy = dict(max_tokens=4, temperature=0, ignore_eos=True)
    want = llm.generate([[3, 4, 5, 6]], SamplingParams(**greedy))[0].token_ids
    for bad in (dict(seed=1.5), dict(stop=[5]), dict(stop_token_ids=[2.0])):
        with pytest.raises(ValueError):
            llm.generate([[3, 4, 5, 6]], SamplingParams(**greedy, **bad))
        assert llm.generate([[3, 4, 5, 6]], SamplingParams(**greedy))[0].token_ids == want
    sampled = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    plain = llm.generate([[3, 4, 5, 6]], SamplingParams(**sampled, seed=7, top_k=5))[0].token_ids
    numpy = SamplingParams(**sampled, seed=np.int64(7), top_k=np.int32(5), stop=None)
    assert llm.generate([[3, 4, 5, 6]], numpy)[0].token_ids == plain


def test_a_stop_string_may_be_given_alone(llm):
    """``stop="ab"`` is the one stop string "ab", not the stop strings "a" and "b"."""
    greedy = dict(max_tokens=16, temperature=0, ignore_eos=True)
    text = llm.generate(["The function"], SamplingParams(**greedy))[0].text
    k = next(k for k in range(2, len(text) - 1) if text.find(text[k:k + 2]) == k
             and min(text.find(text[k]), text.find(text[k + 1])) < k)
    out = llm.generate(["The function"], SamplingParams(**greedy, stop=text[k:k + 2]))[0]
    assert (out.text, out.finish_reason) == (text[:k], "stop")


@pytest.mark.parametrize("prompt,words", [
    ([3, 4.5, 6], "got 4.5 in it"),             # int() made it token 4
    ([3, "4", 6], "got '4' in it"),             # int() made it token 4
    ([3, None, 6], "got None in it"),
    ([[3, 4], [[5]]], "got [5] in it"),
    (b"Once upon", "got bytes"),                # its bytes were taken as token ids
    (None, "got NoneType"),
    (7.0, "got float"),
    ({"text": "hi"}, "got keys ['text']"),
    ({"prompt": [3, 4]}, "'prompt' must be a string"),
])
def test_a_prompt_that_is_not_text_or_token_ids_is_refused(llm, prompt, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate(prompt, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_prompts_may_be_vllm_dicts_numpy_arrays_and_logit_bias_keys_strings(llm):
    """vLLM's ``{"prompt": text}`` and ``{"prompt_token_ids": ids}`` are prompts; a numpy array
    is one prompt (1-D) or a batch (2-D); "5" is token 5 in logit_bias, as in OpenAI's API."""
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ids = llm.encode("Once upon")
    want = llm.generate([ids], greedy)[0].token_ids
    outs = llm.generate([{"prompt": "Once upon"}, {"prompt_token_ids": ids}, np.array(ids)], greedy)
    assert [o.token_ids for o in outs] == [want] * 3
    assert [o.token_ids for o in llm.generate(np.array([ids, ids]), greedy)] == [want] * 2
    biased = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logit_bias=bias)
              for bias in ({"5": 100}, {np.int64(5): 100})]
    assert [o.token_ids for o in llm.generate([ids, ids], biased)] == [[5, 5, 5]] * 2


@pytest.mark.parametrize("kwargs,words", [
    (dict(sampling_params={"max_tokens": 2}), "sampling_params must be a SamplingParams"),
    (dict(tenant=None), "tenant must be a non-empty string"),
    (dict(tenant=""), "tenant must be a non-empty string"),
    (dict(cache_salt=5), "cache_salt must be a non-empty string"),
    (dict(cache_salt=""), "cache_salt must be a non-empty string"),
    (dict(qos=["premium"]), "unknown QoS class ['premium']"),
    (dict(lora_request="my-adapter"), "lora_request must be a LoRARequest, None, or a list"),
])
def test_generate_arguments_of_the_wrong_type_are_refused(llm, kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate([3, 4, 5], **kwargs)
    assert not llm.engine.has_unfinished()


def test_a_request_whose_token_cannot_be_appended_fails_alone(monkeypatch):
    """An error while the engine accounts for one request's sampled token (its detokenization
    here) aborts that request only: the others of the step keep that step's token, and finish
    as they would without it. ``LLM.generate`` raises for the failed one, queueing nothing."""
    llm = LLM(device="cpu", num_kv_blocks=64)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = {"a": [5, 6, 7], "bad": [8, 9, 10], "b": [11, 12, 13]}
    clean = {rid: out.outputs[0].token_ids for rid, out in zip(prompts, llm.generate(list(prompts.values()), sp))}
    engine, update = llm.engine, llm.engine.detok.update

    def poisoned(req):
        if req.request_id == "bad" or req.prompt_token_ids == prompts["bad"]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned")
        return update(req)

    monkeypatch.setattr(engine.detok, "update", poisoned)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, sp)
    tokens = {"a": [], "b": []}
    for _ in range(20):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert not engine.has_unfinished()
    failures = engine.take_failures()
    assert list(failures) == ["bad"] and isinstance(failures["bad"], UnicodeDecodeError)
    assert tokens == {"a": clean["a"], "b": clean["b"]}
    assert engine.take_failures() == {}
    engine.check_integrity()
    with pytest.raises(RuntimeError, match="failed in an engine step: UnicodeDecodeError"):
        llm.generate([prompts["a"], prompts["bad"]], sp)
    assert not engine.has_unfinished()


def test_every_block_pinned_is_a_premium_only_engine():
    """``pinned_kv_blocks`` may equal ``num_kv_blocks`` (a replica kept for pinned classes):
    a premium request runs, and a standard one gets the clear error that no block exists for
    its class, not a queue it would wait in forever."""
    llm = LLM(device="cpu", num_kv_blocks=16, pinned_kv_blocks=16)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3, 4, 5]], sp, qos="premium")[0].token_ids) == 3
    with pytest.raises(ValueError, match="needs 1 KV blocks but only 0 exist for QoS class 'standard'"):
        llm.generate([[1, 2, 3]], sp)
    assert not llm.engine.has_unfinished()
    llm.check_integrity()
