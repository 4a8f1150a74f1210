"""Token events of one request, coalesced before they leave the replica.

Every event a replica yields costs the same however many tokens it carries: a Ray streaming
item to the gateway, an SSE chunk through the gateway, the Serve proxy and the client. Under a
flood that per-event work, for every lower-class token, is what premium requests queue behind
in those processes. So a request streams ``stream_interval`` tokens per event (its QoS class
sets it, like vLLM's and SGLang's ``--stream-interval``):

- the first token goes at once (time to first token is never held back);
- then an event when ``stream_interval`` tokens are held (``0``: only at the end, for a
  request nobody reads token by token, e.g. non-streaming);
- the final event (a ``finish_reason``) and an error go at once, after what is held;
- whatever has piled up while the reader was busy goes out as one event, whatever the
  interval (a backlog is never sent token by token).

An event is ``{"token_ids", "text", "finish_reason", ...}`` (see ``LLMReplica.generate``);
merged events concatenate ids, text and logprobs, keep the first event's ``replica_ms`` and
take every other field from the newest.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


def is_last(event: dict) -> bool:
    return event.get("finish_reason") is not None or "error" in event


def merge(held: dict, event: dict) -> dict:
    """``held`` followed by ``event`` as one event (neither is an error event)."""
    merged = {**held, **event, "token_ids": held["token_ids"] + event["token_ids"],
              "text": held["text"] + event["text"]}
    if "replica_ms" in held:
        merged["replica_ms"] = held["replica_ms"]
    if "logprobs" in held or "logprobs" in event:
        merged["logprobs"] = held.get("logprobs", []) + event.get("logprobs", [])
    return merged


async def coalesced(queue: asyncio.Queue, interval: int) -> AsyncIterator[dict]:
    """Events from ``queue`` until the last one (see the module docstring for the rule)."""
    held: dict | None = None
    sent_token = False
    while True:
        event = await queue.get()
        while True:
            if "error" in event:
                if held is not None:
                    yield held
                yield event
                return
            held = event if held is None else merge(held, event)
            if is_last(held) or queue.empty():
                break
            event = queue.get_nowait()          # a backlog: fold it in before sending
        n = len(held["token_ids"])
        if is_last(held) or (n and not sent_token) or (interval and n >= interval):
            yield held
            sent_token = sent_token or n > 0
            if is_last(held):
                return
            held = None
