"""The context a checkpoint allows, as vLLM derives it: its length fields, stretched by a RoPE
scaling that stretches positions (a Qwen2.5 given YaRN x4 serves 131,072 tokens, not 32,768).
The engine and the gateway (which reads only the config) agree, and tokens past the
checkpoint's trained positions are the ones transformers computes with the same scaling."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, PretrainedConfig

from kvharbor import LLM, SamplingParams
from kvharbor.engine.model_info import context_length, model_context_length
from kvharbor.engine.models import load_model

from .conftest import hf_greedy, random_prompt


def _llama(**rope) -> LlamaConfig:
    config = LlamaConfig(max_position_embeddings=4096)
    if rope:
        config.rope_parameters = {**config.rope_parameters, **rope}
    return config


@pytest.mark.parametrize(("config", "want"), [
    (_llama(), 4096),
    (_llama(rope_type="linear", factor=2.0), 8192),
    (_llama(rope_type="dynamic", factor=4.0), 16384),
    (_llama(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024), 4096),
    (_llama(rope_type="yarn", factor=4.0), 16384),          # no original: the config's length
    (_llama(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=1024), 4096),  # already the stretched length
    (GPT2Config(n_positions=1024), 1024),
    (PretrainedConfig(), 2048),                             # no length at all
])
def test_the_context_is_the_configs_length_stretched_by_its_rope_scaling(config, want):
    assert context_length(config) == want


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory):
    """tiny-llama (4,096 positions) saved with YaRN x2 over them."""
    path = tmp_path_factory.mktemp("yarn")
    loaded = load_model("kvharbor/tiny-llama", torch.float32, torch.device("cpu"), 0)
    config = loaded.model.config
    config.rope_parameters = {**config.rope_parameters, "rope_type": "yarn", "factor": 2.0,
                              "original_max_position_embeddings": 4096}
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return str(path)


def test_a_yarn_checkpoint_serves_past_its_trained_positions_as_transformers_does(yarn_checkpoint):
    llm = LLM(model=yarn_checkpoint, device="cpu", num_kv_blocks=600)
    assert llm.engine.max_model_len == model_context_length(yarn_checkpoint) == 8192
    prompt = random_prompt(4200, seed=7)                     # past the 4,096 trained positions
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(llm.hf_model, [prompt], new_tokens=3)[0]
    with pytest.raises(ValueError, match="exceeds the model's context of 8192 tokens"):
        llm.generate([random_prompt(8190, seed=8)], SamplingParams(max_tokens=3))
