"""A beam-search request on the replica (``GenerateRequest.beam``, the rule in
``kvharbor.engine.beam_search``).

Each round's beams are this replica's own one-token requests, sent through ``LLMReplica.generate``
like any request (the class queue and batching of the caller's class, the prefix cache: a beam's
prefix is a cache hit, so a round computes about one partial block per beam). The search runs
here, next to the KV it reuses, so the gateway pays one call, not one per round. When it ends,
the stream sends one final event per answered beam, best first, ``"beam": j`` on the ``j``-th;
the first carries ``replica_ms`` (the whole search) and the prompt's ``prompt_logprobs`` when
asked. An error or abort event of any round ends the stream as it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from kvharbor.engine.beam_search import BeamSearch, BeamSearchParams
from kvharbor.platform.protocol import GenerateRequest


async def beam_events(generate: Callable[[GenerateRequest], AsyncIterator[dict]], request: GenerateRequest,
                      engine, replica_id: str) -> AsyncIterator[dict]:
    """The events of ``request`` (``request.beam`` set), its rounds run through ``generate``."""
    started = time.perf_counter()
    sampling = request.sampling
    try:
        search = BeamSearch(request.prompt_token_ids, BeamSearchParams(**request.beam),
                            engine.eos_ids, engine.eos_id)
    except (TypeError, ValueError) as e:
        yield {"error": f"bad beam search parameters: {e}", "status": 400, "retryable": False}
        return
    want = sampling.get("logprobs")
    k = max(search.num_candidates, want or 0)
    first: dict | None = None
    while not search.done:
        asked = search.prompts()
        rounds = [_round(generate, request, f"{request.request_id}/b{search.rounds}.{j}", ids, k,
                         sampling.get("prompt_logprobs") if first is None else None)
                  for j, ids in enumerate(asked)]
        results = await asyncio.gather(*rounds)
        for event in results:
            if "error" in event or event.get("finish_reason") == "abort":
                yield event
                return
        first = first or results[0]
        search.advance([event["logprobs"][0][1][:search.num_candidates] for event in results])
    tokenizer, skip = engine.tokenizer, sampling.get("skip_special_tokens", True)
    for j, seq in enumerate(search.best()):
        ids = seq.tokens[search.num_prompt_tokens:]
        event = {"token_ids": ids, "text": tokenizer.decode(search.text_ids(seq), skip_special_tokens=skip),
                 "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
                 "num_cached_tokens": first["num_cached_tokens"],
                 "num_prompt_tokens": search.num_prompt_tokens, "num_output_tokens": len(ids),
                 "replica_id": replica_id, "beam": j}
        if want is not None:
            event["logprobs"] = [(lp, top[:want]) for lp, top in seq.logprobs]
        if j == 0:
            event["replica_ms"] = (time.perf_counter() - started) * 1000.0
            if "prompt_logprobs" in first:
                event["prompt_logprobs"] = first["prompt_logprobs"]
        yield event


async def _round(generate, request: GenerateRequest, rid: str, ids: list[int], k: int,
                 prompt_k: int | None) -> dict:
    """One beam's round: a one-token request of ``ids`` with ``k`` alternatives; its final event."""
    one = dataclasses.replace(
        request, request_id=rid, prompt_token_ids=ids, block_hashes=[], session_id=None, beam=None,
        stream_interval=0, metadata={},
        sampling={"max_tokens": 1, "temperature": 0.0, "logprobs": k, "prompt_logprobs": prompt_k})
    last: dict = {"token_ids": [], "text": "", "finish_reason": "abort", "replica_id": None}
    async for event in generate(one):
        last = event
    return last
