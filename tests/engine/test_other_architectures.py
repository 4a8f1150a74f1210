"""Checkpoints of architectures kvharbor's own forward does not cover run through
transformers' forward with kvharbor's paged attention: their greedy tokens equal transformers'
own, batched, in chunks and over cached prefixes. Tiny random checkpoints of each are built
here (no download), with the builtin byte tokenizer."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvharbor import LLM, SamplingParams
from kvharbor.engine.tokenizer import byte_tokenizer

from .conftest import hf_greedy, random_prompt

_SHAPE = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=257, eos_token_id=258, pad_token_id=256)
ARCHITECTURES = {
    "gemma": ("GemmaConfig", dict(_SHAPE, head_dim=16)),
    "gpt2": ("GPT2Config", dict(vocab_size=259, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                bos_token_id=257, eos_token_id=258)),
    "gpt_neox": ("GPTNeoXConfig", {k: v for k, v in _SHAPE.items() if k != "num_key_value_heads"}),
    "mixtral": ("MixtralConfig", dict(_SHAPE, num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", _SHAPE),
    "qwen3": ("Qwen3Config", dict(_SHAPE, head_dim=16)),
    "stablelm": ("StableLmConfig", _SHAPE),     # its layers do not pass kwargs to attention
}


def save_checkpoint(architecture: tuple[str, dict], path) -> str:
    """A seeded random checkpoint of ``architecture`` (an ``ARCHITECTURES`` value) with the
    byte tokenizer, saved at ``path``; the path as a string."""
    config_class, fields = architecture
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**fields))
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_checkpoint_outside_kvharbors_forward_serves_transformers_greedy_tokens(arch, tmp_path):
    llm = LLM(model=save_checkpoint(ARCHITECTURES[arch], tmp_path), device="cpu", num_kv_blocks=128,
              max_num_batched_tokens=64)
    assert llm.engine.runner.fast is None                  # transformers' forward
    shared = random_prompt(70, 1)
    prompts = [random_prompt(5, 0), shared, random_prompt(130, 2)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp)                       # 130 tokens: three chunks of <= 64
    again = llm.generate([shared + random_prompt(20, 3)], sp)[0]
    assert again.num_cached_tokens == 64                   # over the first request's blocks
    want = hf_greedy(llm.hf_model, prompts + [shared + random_prompt(20, 3)], new_tokens=8)
    assert [o.token_ids for o in outs] + [again.token_ids] == want
    llm.check_integrity()
