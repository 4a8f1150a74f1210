"""Context overflow of a chat: ``truncate_oldest`` drops the oldest turns, keeps the system prompt.

A tenant with ``context_overflow: truncate_oldest`` (tenants.yaml) gets an over-long chat
served instead of a 400: leading system messages and the last message always stay; the
oldest other messages are dropped one at a time, and then any assistant or tool message left
at the front of the conversation (a conversation restarts with a user turn: no tool result
without the call it answers), until the rendered prompt plus the wanted output fits the
context (the Responses API's ``truncation: "auto"`` asks the same for one request)::

    [system][user1][asst1][user2][asst2][user3]      too long
    [system]              [user2][asst2][user3]      fits: user1 + asst1 dropped

The reply says how many prompt tokens were dropped (``X-Truncated-Tokens`` and
``kvharbor.truncated_prompt_tokens``). If even the system messages plus the last message do
not fit, nothing is dropped and the usual 400 (``context_length_exceeded``) answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

TRUNCATED_HEADER = "X-Truncated-Tokens"


@dataclass(slots=True)
class Fitted:
    """The prompt to send and what truncation removed (0 and 0 when nothing was)."""

    token_ids: list[int]
    dropped_tokens: int = 0
    dropped_messages: int = 0


def truncate_oldest(messages: list[dict], render: Callable[[list[dict]], list[int]],
                    max_prompt_tokens: int) -> Fitted:
    """Drop the oldest non-system messages until ``render(messages)`` has at most
    ``max_prompt_tokens`` tokens (see module doc). Renders O(messages) times."""
    ids = render(messages)
    if len(ids) <= max_prompt_tokens:
        return Fitted(ids)
    head = 0
    while head < len(messages) - 1 and messages[head]["role"] == "system":
        head += 1
    system, rest = messages[:head], messages[head:]
    dropped = 0
    while len(rest) > 1:
        rest = rest[1:]
        dropped += 1
        while len(rest) > 1 and rest[0]["role"] in ("assistant", "tool"):
            rest = rest[1:]
            dropped += 1
        fitted = render(system + rest)
        if len(fitted) <= max_prompt_tokens:
            return Fitted(fitted, len(ids) - len(fitted), dropped)
    return Fitted(ids)
