"""Engine test helpers: prompts with shared prefixes and the transformers oracle."""

from __future__ import annotations

import random

import pytest
import torch

NEW_TOKENS = 10


def mixed_prompts(n: int = 16, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """``n`` token prompts, 1 to ~330 tokens, several sharing 40- and 200-token prefixes."""
    rng = random.Random(seed)
    short_prefix = [rng.randrange(vocab) for _ in range(40)]
    long_prefix = [rng.randrange(vocab) for _ in range(200)]
    lengths = [1, 2, 5, 17, 33, 64, 129, 150, 200, 250, 301, 330, 7, 90, 45, 310]
    prompts = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        body = [rng.randrange(vocab) for _ in range(length)]
        if i % 4 == 1 and length > 1:
            body = (short_prefix + body)[:max(length, 41)]
        elif i % 4 == 2 and length > 1:
            body = (long_prefix + body)[:max(length, 201)]
        prompts.append(body)
    return prompts


def hf_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuation of each prompt by the stock transformers model, one at a time."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="session")
def oracle_cache():
    """Memo of transformers' greedy outputs keyed by model name (weights are seeded)."""
    return {}
