"""Arguments a user can get wrong raise ValueError naming the fix."""

from __future__ import annotations

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
