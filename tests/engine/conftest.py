"""Engine test helpers: prompts (random, or with shared prefixes), greedy sampling, the
transformers oracle, and an announcer that plays the replica's event loop mid-step."""

from __future__ import annotations

import random

import pytest
import torch

from kvharbor import SamplingParams
from kvharbor.engine.step_budget import StepInterrupt

NEW_TOKENS = 10


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` random token ids below 256, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def start_request(kv, rid: str, prompt: list[int], use_cache: bool = True, pinned: bool = False):
    """Schedule ``prompt`` whole on a ``KVCacheManager`` (a request of a pinned class when
    ``pinned``), compute it and cache its full blocks; the ``Request``."""
    from kvharbor.engine.request import Request

    req = Request(rid, prompt, SamplingParams(), pinned=pinned)
    hit = kv.get_computed_blocks(req) if use_cache else None
    done = hit.num_tokens if hit else 0
    assert kv.can_allocate(req, req.num_tokens - done, hit)
    kv.allocate(req, req.num_tokens - done, hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return req


def greedy(n: int) -> SamplingParams:
    """Exactly ``n`` greedy tokens."""
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


class AnnounceAt(StepInterrupt):
    """The engine's step interrupt, announcing each ``(qos, at)`` in ``due`` from inside the
    forward (as the replica's event loop does while the step thread runs), once each: ``at`` a
    layer (just before its attention) or ``(layer, "mlp")`` (just before its MLP)."""

    __slots__ = ("engine", "due")

    def __init__(self, engine) -> None:
        super().__init__(engine.runner.num_layers)
        self.interruptible = engine.interrupt.interruptible
        self.engine, self.due = engine, []

    def check(self, layer: int, before_mlp: bool = False) -> None:
        here = (layer, "mlp") if before_mlp else layer
        for qos, at in list(self.due):
            if here == at:
                self.engine.announce(qos)
                self.due.remove((qos, at))
        super().check(layer, before_mlp)


def install_announcer(engine) -> AnnounceAt:
    """Replace ``engine``'s step interrupt by an ``AnnounceAt`` (nothing due yet)."""
    engine.interrupt = engine.runner.interrupt = AnnounceAt(engine)
    return engine.interrupt


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
