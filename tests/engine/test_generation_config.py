"""vLLM's ``generation_config`` / ``override_generation_config``: a request that leaves a
sampling field unset samples with the model's ``generation_config.json`` value (Qwen3 ships
temperature 0.6, top_p 0.95, top_k 20), offline (``LLM.generate`` / ``chat`` without
sampling params) and over HTTP (the gateway fills the request's unset or null fields);
``"vllm"`` keeps the neutral values. The HTTP path end to end is in
``tests/platform/test_serve_run.py`` (a checkpoint with a generation config, served); a bad
one refused before Ray starts in ``tests/platform/test_engine_settings.py``."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvharbor import LLM, SamplingParams
from kvharbor.config import PlatformConfig
from kvharbor.engine.model_info import sampling_defaults
from kvharbor.engine.tokenizer import byte_tokenizer
from kvharbor.platform.openai_protocol import ChatRequest, CompletionRequest
from kvharbor.platform.prompts import Prompts
from tests.conftest import prompt_principal as tenant

SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "max_new_tokens": 300}


def generation_config(folder, **fields) -> str:
    """A folder holding a generation_config.json of ``fields`` (with the token ids and
    ``do_sample`` a checkpoint's has beside them); its path as a string."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 257, "eos_token_id": 258, "do_sample": True, **fields}))
    return str(folder)


def test_the_default_sampling_comes_from_the_generation_config_as_vllm_takes_it(tmp_path):
    folder = generation_config(tmp_path / "model", **SAMPLING)
    want = {**SAMPLING, "max_tokens": 300}
    del want["max_new_tokens"]
    assert sampling_defaults(folder) == want                         # 'auto': the model's own
    assert sampling_defaults(folder, "vllm") == {}                   # the neutral values
    assert sampling_defaults("kvharbor/tiny-llama") == {}            # builtin models have none
    assert sampling_defaults("kvharbor/tiny-llama", folder) == want  # a folder's, for any model
    assert sampling_defaults(generation_config(tmp_path / "ids")) == {}     # token ids only
    assert sampling_defaults(str(tmp_path / "no-generation-config")) == {}  # no file: neutral
    over = {"temperature": 0.2, "max_new_tokens": 5}
    assert sampling_defaults(folder, "auto", over) == {**want, "temperature": 0.2, "max_tokens": 5}
    assert sampling_defaults(folder, "vllm", over) == {"temperature": 0.2, "max_tokens": 5}


@pytest.mark.parametrize("args, message", [
    (("missing",), "is not 'auto', 'vllm' or a folder"),
    (("auto", {"eos_token_id": 3}), "got eos_token_id"),
    (("auto", {"top_p": 0.0}), "top_p must be in (0, 1]"),
    (("auto", {"temperature": -1}), "temperature must be"),
])
def test_a_generation_config_the_engine_cannot_use_is_refused_at_start(tmp_path, args, message):
    folder = generation_config(tmp_path / "model", temperature=0.7)
    generation, *override = args
    generation = str(tmp_path / generation) if generation == "missing" else generation
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        sampling_defaults(folder, generation, *override)


def test_serve_runs_override_generation_config_takes_json():
    cfg = PlatformConfig(override_generation_config='{"temperature": 0.5, "top_k": 4}')
    assert cfg.override_generation_config == {"temperature": 0.5, "top_k": 4}
    with pytest.raises(ValidationError, match="override_generation_config takes JSON"):
        PlatformConfig(override_generation_config="temperature=0.5")


def test_offline_generate_and_chat_sample_with_the_models_generation_config(tmp_path):
    """A checkpoint whose generation config asks for top_k 1 (greedy), a strong repetition
    penalty and 6 new tokens: ``generate`` and ``chat`` without sampling params give exactly
    what those params given explicitly give, and not what the neutral values give."""
    from tests.engine.test_other_architectures import ARCHITECTURES, save_checkpoint

    checkpoint = save_checkpoint(ARCHITECTURES["qwen3"], tmp_path / "qwen3")
    config = json.loads((tmp_path / "qwen3" / "generation_config.json").read_text())
    fields = {"temperature": 0.7, "top_k": 1, "repetition_penalty": 3.0}
    (tmp_path / "qwen3" / "generation_config.json").write_text(
        json.dumps({**config, **fields, "max_new_tokens": 6}))
    llm = LLM(model=checkpoint, device="cpu", num_kv_blocks=64)
    explicit = SamplingParams(max_tokens=6, **fields)
    assert llm.get_default_sampling_params() == explicit
    prompt = [40, 41, 42, 43] * 8 + [248, 52, 238, 71, 48, 62]   # and its greedy continuation
    out = llm.generate([prompt])[0].outputs[0].token_ids
    assert out == llm.generate([prompt], explicit)[0].outputs[0].token_ids
    assert len(out) == 6
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    assert greedy == [62] * 6 and out != greedy         # the model repeats; the penalty stops it
    chat = [{"role": "user", "content": "Hi there"}]
    assert llm.chat(chat)[0].outputs[0].token_ids == llm.chat(chat, explicit)[0].outputs[0].token_ids
    assert LLM(model=checkpoint, device="cpu", num_kv_blocks=64,
               generation_config="vllm").get_default_sampling_params() == SamplingParams()
    over = LLM(model=checkpoint, device="cpu", num_kv_blocks=64, override_generation_config={"top_k": 3})
    assert over.get_default_sampling_params() == SamplingParams(max_tokens=6, **{**fields, "top_k": 3})


def test_an_http_request_gets_the_default_for_each_field_it_leaves_unset_or_null():
    defaults = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 300}
    body = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                       temperature=0.3, top_p=None, top_k=0)
    assert body.sampling_values(defaults) == {
        "temperature": 0.3, "top_k": 0,                 # the request's own, 0 included
        "repetition_penalty": 1.1,                      # unset: the model's
        "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # neutral
    assert CompletionRequest(model="m", prompt="x", temperature=1e-9).sampling_values(defaults)[
        "temperature"] == 0.0                           # a tiny temperature is still greedy
    assert CompletionRequest(model="m", prompt="x", repetition_penalty=None).sampling_values(
        defaults)["repetition_penalty"] == 1.1          # null: the default, as vLLM


def test_a_chat_without_max_tokens_gets_the_generation_configs_within_the_tenants_cap():
    prompts = Prompts(byte_tokenizer(), 4096, {"max_tokens": 40})
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    ids = [prompts.fit_chat(chat, tenant()).token_ids]
    assert prompts.limits(chat, ids, True, tenant())[0] == 40
    assert prompts.limits(chat, ids, True, tenant(25))[0] == 25
    assert prompts.limits(chat.model_copy(update={"max_tokens": 50}), ids, True, tenant())[0] == 50
    completion = CompletionRequest(model="m", prompt="hi")      # completions: 16, as vLLM's
    assert prompts.limits(completion, prompts.completion_ids(completion), False, tenant())[0] == 16

