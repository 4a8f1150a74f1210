"""The rest of vLLM's offline API a script reaches for: each output's prompt text,
``get_tokenizer``, ``SamplingParams.clone`` and ``generate(..., use_tqdm=True)``."""

from __future__ import annotations

import pickle

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
