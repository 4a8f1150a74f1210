"""Logprobs through the official openai client, checked against the model's own log-softmax:
completions' and chat's ``logprobs``, and ``echo`` (the prompt before the answer, its tokens
scored when logprobs are asked)."""

from __future__ import annotations

import openai
import pytest

from kvharbor.platform import openai_shapes as shapes
from tests.conftest import DEMO


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


# ---- logprobs / top_logprobs, checked against the model's own log-softmax ----------------------
@pytest.fixture(scope="module")
def reference():
    """The model's raw next-token log-softmax over a token sequence (tiny-llama, float32, CPU)."""
    import torch

    from kvharbor.engine.model_info import load_tokenizer
    from kvharbor.engine.models import load_model

    loaded = load_model("kvharbor/tiny-llama", torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer("kvharbor/tiny-llama")

    def log_softmax(ids: list[int]):
        with torch.no_grad():
            logits = loaded.model(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)                  # [len(ids), V]

    def token_id(text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    log_softmax.token_id = token_id
    log_softmax.tokenizer = tokenizer
    return log_softmax


def _check_against_reference(reference, prompt_ids, tokens, token_lps, tops, k):
    ids = [reference.token_id(t) for t in tokens]
    ref = reference(prompt_ids + ids)[len(prompt_ids) - 1:-1]      # row i predicts output token i
    for i, tid in enumerate(ids):
        assert abs(token_lps[i] - float(ref[i, tid])) < 2e-4, (i, token_lps[i], float(ref[i, tid]))
        best = ref[i].topk(k).values.tolist()
        assert len(tops[i]) == k and all(abs(a - b) < 2e-4 for a, b in zip(sorted(tops[i], reverse=True), best)), (tops[i], best)


def test_completion_logprobs_are_the_models_own(client, kvharbor_app, reference):
    prompt = [40, 41, 72, 101, 108, 108, 111, 32]
    out = client.completions.create(model=kvharbor_app.model, prompt=prompt, max_tokens=8, temperature=0.8,
                                    seed=11, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    _check_against_reference(reference, prompt, lp.tokens, lp.token_logprobs,
                             [_without_chosen(d, t, 3) for d, t in zip(lp.top_logprobs, lp.tokens)], 3)
    plain = client.completions.create(model=kvharbor_app.model, prompt=prompt, max_tokens=2)
    assert plain.choices[0].logprobs is None


def _without_chosen(top: dict, token: str, k: int) -> list[float]:
    """A completions position's top_logprobs holds the chosen token (OpenAI: "up to logprobs+1
    elements"); the values of the k most likely, the chosen one left out if it is not one."""
    assert token in top and k <= len(top) <= k + 1, (token, top)
    if len(top) == k:
        return list(top.values())
    assert min(top, key=top.get) == token, (token, top)       # outside the k best: the extra one
    return [v for t, v in top.items() if t != token]


def _same_scores(a: list, b: list) -> bool:
    """Two requests' scores agree: the same tokens (keys) in the same places, each value equal to
    float32 rounding. Exact equality is not promised: the app's two replicas may each time their
    matrix kernels differently and so sum in another order (1e-6 apart, seen in CI)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, dict) and isinstance(y, dict):
            if list(x) != list(y) or any(abs(x[t] - y[t]) > 1e-5 for t in x):
                return False
        elif (x is None) != (y is None) or (x is not None and abs(x - y) > 1e-5):
            return False
    return True


def test_completion_logprobs_always_hold_the_chosen_token(client, kvharbor_app):
    """Legacy completions list the chosen token at every position, as OpenAI and vLLM do: with
    ``logprobs: 0`` it is the only entry, and a sampled token outside the best ones is added."""
    kw = dict(model=kvharbor_app.model, prompt="The harbor", max_tokens=12, extra_body={"ignore_eos": True})
    zero = client.completions.create(logprobs=0, temperature=0, **kw).choices[0].logprobs
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs)]
    hot = client.completions.create(logprobs=1, temperature=1.5, seed=5, **kw).choices[0].logprobs
    for token, value, top in zip(hot.tokens, hot.token_logprobs, hot.top_logprobs):
        assert top[token] == value and len(top) == (1 if max(top.values()) == value else 2), (token, top)
    assert any(len(top) == 2 for top in hot.top_logprobs)      # this seed samples below the best
    streamed = [top for chunk in client.completions.create(logprobs=1, temperature=1.5, seed=5, stream=True, **kw)
                if chunk.choices and chunk.choices[0].logprobs for top in chunk.choices[0].logprobs.top_logprobs]
    assert _same_scores(streamed, hot.top_logprobs), (streamed, hot.top_logprobs)


def test_chat_logprobs_streamed_equal_non_streamed_and_the_model(client, kvharbor_app, reference):
    messages = [{"role": "user", "content": "Name a harbor."}]
    kw = dict(model=kvharbor_app.model, messages=messages, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kw) if chunk.choices
                and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content] and len(content) == 6
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(streamed, content))
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-6 for c in content)    # greedy: the best
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    _check_against_reference(reference, ids, [c.token for c in content], [c.logprob for c in content],
                             [[t.logprob for t in c.top_logprobs] for c in content], 2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs") as refused:
        client.chat.completions.create(model=kvharbor_app.model, messages=messages, top_logprobs=2)
    assert refused.value.body["param"] == "top_logprobs"        # a check across fields names its field


# ---- echo ---------------------------------------------------------------------------------------
def test_echo_puts_each_prompt_before_its_answer(client, kvharbor_app):
    """Completions' ``echo``: the prompt as sent (token ids decoded), then the answer, streamed
    or not, for each prompt of a batch and each of its choices."""
    kw = dict(model=kvharbor_app.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt="The harbor at dawn", **kw).choices[0].text
    echoed = client.completions.create(prompt="The harbor at dawn", echo=True, **kw)
    assert echoed.choices[0].text == "The harbor at dawn" + plain
    assert echoed.usage.completion_tokens == 6
    streamed = client.completions.create(prompt="The harbor at dawn", echo=True, stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    ids = [72, 101, 108, 108, 111]                                   # "Hello"
    by_ids = client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
    assert by_ids == "Hello" + client.completions.create(prompt=ids, **kw).choices[0].text
    batch = client.completions.create(prompt=["Tides", "Ships"], n=2, echo=True, **kw)
    assert [c.text[:5] for c in batch.choices] == ["Tides", "Tides", "Ships", "Ships"]
    assert batch.choices[2].text == "Ships" + client.completions.create(prompt="Ships", **kw).choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(client, kvharbor_app, reference):
    """With ``logprobs``, the prompt's tokens come first in the logprobs object: each one's
    log-probability given the tokens before it (the first: null), the model's own, and its
    best alternatives; then the answer's. How lm-evaluation-harness scores a text."""
    prompt = [40, 41, 72, 101, 108, 108, 111, 32]
    kw = dict(model=kvharbor_app.model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    client.completions.create(**{**kw, "echo": False})               # the prompt is cached now
    out = client.completions.create(**kw)
    lp, text = out.choices[0].logprobs, out.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 3
    assert "".join(lp.tokens) == text and text.startswith("()Hello ")
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(prompt)
    for i in range(1, len(prompt)):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, prompt[i]])) < 2e-4, i
        best = ref[i - 1].topk(2).values.tolist()
        top = _without_chosen(lp.top_logprobs[i], lp.tokens[i], 2)
        assert all(abs(a - b) < 2e-4 for a, b in zip(sorted(top, reverse=True), best)), i
    _check_against_reference(reference, prompt, lp.tokens[len(prompt):], lp.token_logprobs[len(prompt):],
                             [_without_chosen(d, t, 2) for d, t in zip(lp.top_logprobs[len(prompt):],
                                                                       lp.tokens[len(prompt):])], 2)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == text
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens
    assert _same_scores([v for c in chunks for v in c.logprobs.token_logprobs], lp.token_logprobs)
    two = client.completions.create(n=2, **{**kw, "temperature": 1.0, "seed": 3})
    assert all(_same_scores(c.logprobs.token_logprobs[:len(prompt)], lp.token_logprobs[:len(prompt)])
               for c in two.choices)


def test_echo_with_max_tokens_zero_answers_the_prompt_alone(client, kvharbor_app, reference):
    """vLLM's echo with ``max_tokens: 0``: the prompt and its scores, no generated token (none
    in the text, the logprobs or the usage); ``max_tokens: 0`` without echo is a 400."""
    prompt = [40, 41, 72, 101, 108, 108, 111, 32]
    kw = dict(model=kvharbor_app.model, prompt=prompt, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    longer = client.completions.create(max_tokens=3, **kw).choices[0].logprobs
    only = client.completions.create(max_tokens=0, **kw)
    assert only.choices[0].text == "()Hello " and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.tokens == longer.tokens[:len(prompt)]
    assert _same_scores(only.choices[0].logprobs.token_logprobs, longer.token_logprobs[:len(prompt)])
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(prompt)
    chunks = [c for c in client.completions.create(max_tokens=0, stream=True, **kw) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == "()Hello "
    assert chunks[-1].choices[0].finish_reason == "length"
    eos = reference.tokenizer.eos_token_id                  # the hidden token is EOS: still "length"
    forced = client.completions.create(model=kvharbor_app.model, prompt=prompt, echo=True, max_tokens=0,
                                       logit_bias={str(eos): 100})
    assert forced.choices[0].finish_reason == "length" and forced.choices[0].text == "()Hello "
    for body, param in (({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "hi", "max_tokens": 0, "echo": True, "extra_body": {"min_tokens": 1}}, "min_tokens")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=kvharbor_app.model, **body)
        assert info.value.body["param"] == param, info.value.body
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=kvharbor_app.model, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=0)


# ---- the shapes for tokens of several characters, and beyond ASCII -----------------------------
# (the builtin tokenizers' tokens are single bytes, so the HTTP tests above cannot tell these apart)
class _Pieces:
    """A tokenizer of three multi-character tokens."""

    def decode(self, ids: list[int]) -> str:
        return {1: "Hello", 2: ",", 3: " w\u00f6rld"}[ids[0]]


TEXT_OF = shapes.TokenText(_Pieces())


def test_text_offsets_count_each_tokens_characters():
    part = shapes.completion_logprobs([(-0.1, ()), (-0.2, ()), (-0.3, ())], [1, 2, 3], TEXT_OF, 4)
    assert part["tokens"] == ["Hello", ",", " w\u00f6rld"]
    assert part["text_offset"] == [4, 9, 10]


def test_chat_logprob_bytes_are_each_tokens_utf8():
    entry = shapes.chat_logprobs([(-0.5, ((3, -0.5), (1, -1.5)))], [3], TEXT_OF)["content"][0]
    assert entry["bytes"] == [32, 119, 195, 182, 114, 108, 100]
    assert [t["bytes"] for t in entry["top_logprobs"]] == [[32, 119, 195, 182, 114, 108, 100], list(b"Hello")]
