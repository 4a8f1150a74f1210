"""How a chat's answer is read when it is more than text (a mixin of ``GenerationRun``): tool
calls (``tool_calls``: a named function, ``required``; ``tool_parsers``: ``auto``) and a thinking
model's reasoning (``reasoning``), for the whole answer and for a stream piece by piece."""

from __future__ import annotations

from kvharbor.platform import openai_shapes as shapes
from kvharbor.platform import reasoning, tool_calls, tool_parsers


class ParsedAnswers:
    """``GenerationRun``'s parsing of tool calls and reasoning. Reads the run's ``choices``,
    ``tool_mode``, ``reasoning``, ``one_call`` and ``_finish_reason``."""

    def _calls(self, text: str | None, reason: str) -> tuple[str | None, list[dict] | None]:
        """A finished choice's content and ``tool_calls`` (None: its text is the answer, e.g.
        not a tool call, aborted, or a list of calls ``max_tokens`` cut short)."""
        if text is None or not self.tool_mode or reason == "abort":
            return text, None
        if self.tool_mode == "auto":
            content, calls = tool_parsers.parse(text)
            return content, calls[:1] if calls and self.one_call else calls
        return None, tool_calls.calls_of(text, self.tool_mode)

    def _tool_chunk(self, index: int, text: str, event: dict, part: dict | None) -> dict | None:
        """A stream's chunk for a tool-calling choice. A named function: its arguments as they
        come (the first delta names the call, as vLLM streams it). ``required``: None until the
        choice ends (its text and logprobs are kept), then its calls, or its text when
        ``max_tokens`` cut them short."""
        choice, reason = self.choices[index], self._finish_reason(event)
        if self.tool_mode != "required":
            call = {"index": 0, "function": {"arguments": text}}
            if choice.call_id is None:
                choice.call_id = tool_calls.call_id()
                call = {"index": 0, "id": choice.call_id, "type": "function",
                        "function": {"name": self.tool_mode, "arguments": text}}
            return shapes.tool_delta(index, [call], reason, part)
        choice.text.append(text)
        if part is not None:
            choice.logprobs.append(part)
        if reason is None:
            return None
        whole, logprobs = "".join(choice.text), shapes.merge_logprobs(choice.logprobs, True)
        _, calls = self._calls(whole, reason)
        if calls is None:
            return shapes.choice(index, whole, reason, True, final=False, logprobs=logprobs)
        return shapes.tool_delta(index, [{"index": i, **c} for i, c in enumerate(calls)],
                                 self._tool_reason(reason), logprobs)

    def _parsed_chunk(self, index: int, text: str, event: dict, part: dict | None) -> dict | None:
        """A stream's chunk when its text is parsed as it comes: the reasoning apart
        (``reasoning.ReasoningStream``) and, with ``tool_choice: "auto"``, the content apart
        from each call, sent once its block closes (``tool_parsers.StreamParser``). None while
        the text is held back (a possible tag); its logprobs go out with the next chunk."""
        choice, reason = self.choices[index], self._finish_reason(event)
        said, calls, last = "", [], reason is not None
        if self.reasoning is not None:
            choice.thinker = choice.thinker or reasoning.ReasoningStream(*self.reasoning[:2])
            said, text = choice.thinker.feed(text, last)
            said = said if self.reasoning[2] else ""              # include_reasoning false
        if self.tool_mode not in (None, "auto"):
            return self._forced_after_reasoning(index, said, text, event, part)
        if self.tool_mode == "auto":
            choice.parser = choice.parser or tool_parsers.StreamParser()
            text, calls = choice.parser.feed(text, last)
        made = choice.parser.calls if choice.parser else 0
        numbered = enumerate(calls, start=made - len(calls))
        calls = [{"index": i, **c} for i, c in numbered if not (self.one_call and i)]   # parallel_tool_calls false
        if part is not None:
            choice.logprobs.append(part)
        if not (said or text or calls or last):
            return None
        logprobs, choice.logprobs = shapes.merge_logprobs(choice.logprobs, True), []
        if reason not in (None, "abort") and made:
            reason = self._tool_reason(reason)
        return _with_reasoning(shapes.tool_delta(index, calls, reason, logprobs, text), said)

    def _forced_after_reasoning(self, index: int, said: str, text: str, event: dict, part: dict | None):
        """A forced call's stream (a named function, ``required``) when the model reasons
        first (its grammar starts after ``</think>``): the reasoning as it comes, then what
        follows it as ``_tool_chunk`` streams a call."""
        choice = self.choices[index]
        choice.logprobs += [part] if part is not None else []
        if text or self._finish_reason(event) is not None:
            parts, choice.logprobs = choice.logprobs, []
            chunk = self._tool_chunk(index, text, event, shapes.merge_logprobs(parts, True))
            return _with_reasoning(chunk or shapes.tool_delta(index, [], None, None, ""), said) if said else chunk
        if not said:
            return None
        logprobs, choice.logprobs = shapes.merge_logprobs(choice.logprobs, True), []
        return _with_reasoning(shapes.tool_delta(index, [], None, logprobs, ""), said)

    def _tool_reason(self, reason: str) -> str:
        """OpenAI's finish reason of an answer of tool calls: ``tool_calls`` when the model
        chose them (``required``, or calls in an ``auto`` answer), else the engine's (a named
        function: ``stop``, or ``length`` when ``max_tokens`` cut its arguments)."""
        return "tool_calls" if self.tool_mode in ("required", "auto") else reason


def _with_reasoning(chunk: dict, said: str) -> dict:
    """``chunk`` with ``said`` as its ``delta.reasoning`` (none: unchanged), before its calls
    or content (an empty content dropped)."""
    if said:
        chunk["delta"] = {"reasoning": said, **({} if chunk["delta"] == {"content": ""} else chunk["delta"])}
    return chunk
