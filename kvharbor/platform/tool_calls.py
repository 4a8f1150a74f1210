"""Function calling on the chat route, the way vLLM serves it without a model-specific
tool-call parser: the answer is constrained (structured outputs) to the arguments of the named
function (``tool_choice: {"type": "function", "function": {"name"}}``) or to a list of calls
of the given tools (``tool_choice: "required"``), and comes back as ``message.tool_calls``.

``tool_choice: "none"`` shows the tools to the chat template and answers text. ``"auto"`` (the
default with tools) lets the model answer text or calls in its own format, told apart by a
parser (``tool_parsers``; the server's ``tool_call_parser``); without one it is a 400 naming
``tool_choice``. History messages may carry
the assistant's ``tool_calls`` and the ``tool`` role's ``tool_call_id``; the template gets the
arguments as objects, as vLLM hands them over.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from .json_types import REQUEST_FIELDS

MAX_TOOLS = 128
NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDef(BaseModel):
    model_config = REQUEST_FIELDS
    name: str = Field(pattern=NAME, description="The function's name (letters, digits, _ and -, at most 64).")
    description: str | None = Field(None, description="What it does (shown to the chat template).")
    parameters: dict | None = Field(None, description="A JSON schema of its arguments (an object); none: any object.")
    strict: bool | None = Field(None, description="Accepted: the arguments always follow the schema.")


class Tool(BaseModel):
    model_config = REQUEST_FIELDS
    type: Literal["function"] = Field(description="Only function tools.")
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = REQUEST_FIELDS
    name: str = Field(description="One of the tools' names.")


class NamedToolChoice(BaseModel):
    model_config = REQUEST_FIELDS
    type: Literal["function"] = Field(description="Only functions.")
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = REQUEST_FIELDS
    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments as JSON text.")


class ToolCall(BaseModel):
    """A call in an assistant message of the history (as an answer returned it)."""

    model_config = REQUEST_FIELDS
    id: str = Field(description="The call's id (a tool message answers it by tool_call_id).")
    type: Literal["function"] = Field(description="Only functions.")
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _arguments_schema(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object"}


AUTO_NEEDS_PARSER = ('tool_choice "auto" (the default with tools) needs a parser of the model\'s own '
                     'tool-call format: start the server with enable_auto_tool_choice=true '
                     'tool_call_parser=hermes (vLLM\'s flags), or send "required", '
                     '{"type": "function", "function": {"name": ...}} or "none"')


def tool_mode(tools: list[Tool] | None, choice: ToolChoice | None) -> str | None:
    """``"auto"`` (the model's own calls, read by a parser: ``tool_parsers``), ``"required"``,
    the named function, or None (an answer in text). Raises ValueError for a choice that
    cannot be served."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise ValueError("tool_choice needs tools: send the functions in tools")
    if choice in ("auto", "required"):
        return choice
    names = [t.function.name for t in tools]
    if choice.function.name not in names:
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools {names}")
    return choice.function.name


def constraint(tools: list[Tool], mode: str, one: bool = False) -> dict:
    """The engine's ``structured_outputs`` for ``mode``: the named function's arguments, or a
    non-empty JSON list of ``{"name", "parameters"}`` calls of the tools (vLLM's shape; of one
    call when ``one``: ``parallel_tool_calls`` false); compact JSON (whitespace between its
    tokens would only cost tokens)."""
    if mode != "required":
        tool = next(t for t in tools if t.function.name == mode)
        return {"json": _arguments_schema(tool), "disable_any_whitespace": True}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"enum": [t.function.name]}, "parameters": _arguments_schema(t)}}
             for t in tools]
    return {"json": {"type": "array", "minItems": 1, **({"maxItems": 1} if one else {}), "items": {"anyOf": calls}},
            "disable_any_whitespace": True}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def calls_of(text: str, mode: str) -> list[dict] | None:
    """OpenAI's ``tool_calls`` from a constrained answer. A named function's arguments are the
    text as generated, complete or not (as vLLM answers; a stream sends them as they come).
    ``required``: the parsed list; None when it is not complete JSON (``max_tokens`` cut it):
    the text is then answered as it is."""
    if mode != "required":
        return [{"id": call_id(), "type": "function", "function": {"name": mode, "arguments": text}}]
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [{"id": call_id(), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["parameters"])}} for c in calls]


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as chat templates read them (None: none)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def template_calls(calls: list[ToolCall]) -> list[dict]:
    """History tool calls as chat templates read them: arguments as an object when they are
    JSON (as vLLM hands them over), else the text."""
    out = []
    for c in calls:
        try:
            arguments = json.loads(c.function.arguments)
        except json.JSONDecodeError:
            arguments = c.function.arguments
        out.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}})
    return out
