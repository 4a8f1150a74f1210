"""Ray Serve's own ``PrefixCacheAffinityRouter`` on ``LLMReplica``, for side-by-side runs.

Ray's router (``ray.llm._internal.serve.routing_policies.prefix_aware``) keeps a
character-level tree of the prompts it routed, in one actor, and reads the prompt from a
``.prompt`` or ``.messages`` attribute of the first call argument. A ``GenerateRequest``
carries token ids instead, so this subclass changes one thing: it decodes the token ids
back into the prompt text (the builtin models' byte tokenizer: token id = byte value, ids
above 255 are special tokens and are dropped). Its policy (match-rate threshold, smallest
replica fallback, imbalance threshold, tree actor) is untouched.

For the comparison it also writes the time its ``choose_replicas`` took into
``request.metadata["router_decision_ms"]``, as ``KVAwareRouter`` does (measurement only).

    request_router_class="kvharbor.platform.ray_prefix_router:RayPrefixRouter"
"""

from __future__ import annotations

import time

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter)

from kvharbor.platform.router import generate_request_of


def prompt_text(token_ids: list[int]) -> str:
    """The text a byte-tokenized prompt encodes (special tokens dropped)."""
    return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class RayPrefixRouter(PrefixCacheAffinityRouter):
    """``PrefixCacheAffinityRouter`` reading kvharbor's ``GenerateRequest`` (see module doc)."""

    def _extract_text_from_request(self, pending_request) -> str:
        request = generate_request_of(pending_request)
        if request is None:
            return super()._extract_text_from_request(pending_request)
        return prompt_text(request.prompt_token_ids)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        start = time.perf_counter()
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        request = generate_request_of(pending_request)
        if request is not None:
            request.metadata["router_decision_ms"] = (time.perf_counter() - start) * 1000.0
        return ranks
