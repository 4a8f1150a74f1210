"""A thinking model's reasoning apart from its answer (vLLM's ``--reasoning-parser``): the chat
message's ``reasoning`` field holds what the model wrote inside ``<think> ... </think>``, and
``content`` what follows (null when nothing does).

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): the answer starts in reasoning (their
  templates open ``<think>`` in the prompt; an answer that opens with ``<think>`` itself loses
  it) and ``</think>`` ends it; an answer that never writes ``</think>`` is all reasoning.
- ``qwen3`` (Qwen3): the same, and a ``<tool_call>`` also ends the reasoning (the call is then
  read by the tool-call parser); with ``chat_template_kwargs: {"enable_thinking": false}``
  the model does not think and the whole answer is content.

A stream sends each part as it comes, holding back only what could begin a tag.
"""

from __future__ import annotations

# The engine's tags: its grammar waits for END (structured_output.start_reasoning).
from kvharbor.engine.structured_output import THINK_END as END
from kvharbor.engine.structured_output import THINK_START as START
from kvharbor.platform.tool_parsers import START as TOOL_START
from kvharbor.platform.tool_parsers import releasable


def _thinks(parser: str, thinking: bool) -> bool:
    """Does the answer start in reasoning? Only Qwen3 has a switch (``enable_thinking``)."""
    return thinking or parser != "qwen3"


def _ends(parser: str) -> tuple[str, ...]:
    return (END, TOOL_START) if parser == "qwen3" else (END,)


def _first_end(text: str, parser: str) -> int:
    found = [at for tag in _ends(parser) if (at := text.find(tag)) >= 0]
    return min(found) if found else -1


def _drop_start(text: str) -> str:
    """``text`` without the ``<think>`` it opens with (blanks before it too), if it does."""
    bare = text.lstrip()
    return bare[len(START):] if bare.startswith(START) else text


def split(text: str, parser: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a whole answer."""
    if not _thinks(parser, thinking):
        return None, text
    text = _drop_start(text)
    end = _first_end(text, parser)
    if end < 0:
        return text, None
    rest = text[end + len(END):] if text.startswith(END, end) else text[end:]
    return text[:end], rest or None


class ReasoningStream:
    """One streamed answer, piece by piece: ``feed`` returns the reasoning and the content to
    send now."""

    __slots__ = ("parser", "thinking", "held", "started")

    def __init__(self, parser: str, thinking: bool = True) -> None:
        self.parser = parser
        self.thinking = _thinks(parser, thinking)                  # still in the reasoning
        self.held = ""
        self.started = False                                       # its opening <think> is settled

    def feed(self, piece: str, last: bool = False) -> tuple[str, str]:
        """``piece`` added; ``last``: the answer ends with it (what is held goes out)."""
        if not self.thinking:
            return "", piece
        self.held += piece
        if not self.started:             # does the answer open with <think>? wait until it is known
            bare = self.held.lstrip()
            if START.startswith(bare) and len(bare) < len(START) and not last:
                return "", ""
            self.held, self.started = _drop_start(self.held), True
        end = _first_end(self.held, self.parser)
        if end >= 0:
            said, rest = self.held[:end], self.held[end:]
            self.held, self.thinking = "", False
            return said, rest[len(END):] if rest.startswith(END) else rest
        said, self.held = releasable(self.held, _ends(self.parser), last)
        return said, ""

