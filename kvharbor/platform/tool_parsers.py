"""``tool_choice: "auto"``: the model decides between text and calls, and a parser of its own
tool-call format tells them apart in its answer (vLLM's ``--enable-auto-tool-choice
--tool-call-parser``). One format is read: ``hermes``, the one Qwen2.5, Qwen3, Hermes 2/3 and
their chat templates use::

    Some text.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

Read as vLLM's hermes parser reads it: the calls are every ``<tool_call>`` block (the last may
be unclosed); the content is the text before the first one (null when empty); if a block is
not a JSON object with a ``name`` and ``arguments``, nothing is a call and the whole text is
the content.

A stream sends the content as it comes, holding back only what could be the start of
``<tool_call>``, then each call in one delta when its block closes (vLLM sends a call's
arguments in pieces; a client that joins the pieces reads the same call).
"""

from __future__ import annotations

import json
import re

from kvharbor.platform.tool_calls import call_id

START, END = "<tool_call>", "</tool_call>"
_BLOCKS = re.compile(re.escape(START) + r"(.*?)" + re.escape(END) + "|" + re.escape(START) + r"(.*)", re.DOTALL)


def _call(body: str) -> dict | None:
    """The OpenAI tool call a block's JSON names, or None when it names none."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    arguments = json.dumps(obj["arguments"], ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


def parse(text: str) -> tuple[str | None, list[dict] | None]:
    """``(content, calls)`` of a whole answer; calls None when it makes none."""
    at = text.find(START)
    if at < 0:
        return text, None
    calls = [_call(closed or unclosed) for closed, unclosed in _BLOCKS.findall(text, at)]
    if not calls or None in calls:
        return text, None
    return text[:at] or None, calls


class StreamParser:
    """One streamed choice's answer, piece by piece: ``feed`` returns the content to send now
    and the calls whose blocks closed."""

    __slots__ = ("held", "in_calls", "calls")

    def __init__(self) -> None:
        self.held = ""            # text not yet sent: a possible start of START, or an open block
        self.in_calls = False     # past the first START: only calls are sent from here
        self.calls = 0            # calls sent so far

    def feed(self, piece: str, last: bool = False) -> tuple[str, list[dict]]:
        """``piece`` added; ``last``: the answer ends with it (what is held goes out)."""
        self.held += piece
        if not self.in_calls:
            at = self.held.find(START)
            if at < 0:
                content, self.held = releasable(self.held, (START,), last)
                return content, []
            content, self.held, self.in_calls = self.held[:at], self.held[at:], True
        else:
            content = ""
        blocks = []
        while (end := self.held.find(END)) >= 0:
            block, self.held = self.held[:end], self.held[end + len(END):]
            if (start := block.find(START)) >= 0:       # text between blocks is dropped, as parse()
                blocks.append((block[start:], END))
        if last:
            if (start := self.held.find(START)) >= 0:   # an unclosed last block
                blocks.append((self.held[start:], ""))
            self.held = ""
        calls = []
        for block, closing in blocks:
            call = _call(block[len(START):])
            if call is None:
                content += block + closing              # not a call: its text as it came
            else:
                calls.append(call)
        self.calls += len(calls)
        return content, calls


def releasable(text: str, tags: tuple[str, ...], last: bool) -> tuple[str, str]:
    """``text`` as a stream's ``(what it sends now, what it holds back)``: it holds back an end
    that could begin one of ``tags``, and nothing once the ``last`` piece came."""
    keep = 0 if last else max(_overlap(text, tag) for tag in tags)
    return text[:len(text) - keep], text[len(text) - keep:]


def _overlap(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
