"""The request fields that ask for structured outputs, on both generation routes:

- OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``, ``choice``,
  ``grammar`` (EBNF) or ``json_object``, and ``disable_any_whitespace``.

The request models check each spec's shape; ``parse_problem`` then parses it in a worker
thread (xgrammar releases the GIL: a schema that takes seconds does not stall the gateway's
event loop) with a time limit, before the request is admitted or routed: a bad schema, regex or
grammar is a 400 naming the field. A spec that overran the limit is refused at once for a
while, and its tenant's structured requests are refused (429) until its parse ends. The limit
is the spec's, not the machine's: xgrammar's import (seconds, once) runs before the clock
starts; a spec that waited past the limit for a parsing thread never ran and is a 429 (retry);
and a spec whose overrun parse ended having used less CPU than the limit (the machine stalled,
not the spec) is forgotten, not refused for ``SLOW_FOR_S``. The engine compiles the spec
against the tokenizer (:mod:`kvharbor.engine.structured_output`).
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvharbor.engine.structured_output import MAX_SPEC_CHARS, StructuredOutputsParams
from kvharbor.platform.error_body import FieldError
from kvharbor.platform.json_types import REQUEST_FIELDS

MAX_CHOICES = 256
"""Most strings in ``structured_outputs.choice``."""
PARSE_TIMEOUT_S = 5.0
"""Longest a spec may take to parse (its wait for a parsing thread included, xgrammar's
first import not)."""
_PARSERS = ThreadPoolExecutor(2, thread_name_prefix="kvh-spec-parse")
_SLOW: OrderedDict[tuple[str, str], float] = OrderedDict()
"""Specs that did not parse in time (the latest 1,024, by when): refused again without a thread
for ``SLOW_FOR_S``, so one spec sent over and over cannot keep the parsing threads busy."""
SLOW_FOR_S = 600.0
_OVERDUE: dict[str, int] = {}
"""Per tenant, its parses still running after their limit: while it has one, its structured
requests are refused (429), so one tenant's slow specs hold one parsing thread at a time."""
_parser_imported = False
"""Whether ``_import_parser`` ran: later requests skip the thread hop to import it."""
_STATE_LOCK = threading.Lock()
"""Guards ``_SLOW`` and ``_OVERDUE``: an overrun parse ends in its parsing thread."""


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(**REQUEST_FIELDS, populate_by_name=True)
    name: str = Field(max_length=64, description="A name for the schema (as OpenAI's API asks; not used).")
    description: str | None = Field(None, description="What the output is for (not used).")
    schema_: dict | None = Field(None, alias="schema", description="The JSON schema the output follows.")
    strict: bool | None = Field(None, description="Accepted: the output always follows the schema.")


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = REQUEST_FIELDS
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text (no constraint), json_object (any JSON object) or json_schema.")
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema: the schema.")

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        if self.type == "json_schema" and self.json_schema.schema_ is None:
            raise ValueError("json_schema.schema is required: the JSON schema the output follows")
        return self

    def spec(self) -> dict | None:
        """The engine's ``structured_outputs`` fields (None: plain text)."""
        if self.type == "json_object":
            return {"json_object": True}
        return {"json": self.json_schema.schema_} if self.type == "json_schema" else None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``."""

    model_config = ConfigDict(**REQUEST_FIELDS, populate_by_name=True)
    json_: dict | str | None = Field(None, alias="json", description="A JSON schema (an object or its JSON text) the output follows.")
    regex: str | None = Field(None, max_length=MAX_SPEC_CHARS, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES, description=f"The output is one of these strings (1 to {MAX_CHOICES}).")
    grammar: str | None = Field(None, max_length=MAX_SPEC_CHARS, description="An EBNF grammar (xgrammar's syntax, start rule `root`) the output follows.")
    json_object: bool | None = Field(None, description="true: the output is a JSON object.")
    disable_any_whitespace: bool | None = Field(False, description="JSON without optional whitespace (a small model may otherwise emit whitespace until max_tokens).")

    @model_validator(mode="after")
    def _one_kind(self):
        StructuredOutputsParams.of(self.spec())
        return self

    def spec(self) -> dict:
        fields = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object or None,
                  "disable_any_whitespace": bool(self.disable_any_whitespace)}
        return {k: v for k, v in fields.items() if v is not None}


def structured_spec(response_format: ResponseFormat | None, structured: StructuredOutputs | None) -> dict | None:
    """The engine's ``structured_outputs`` for a request (None: no constraint). Raises
    ``FieldError`` (a ValueError naming ``structured_outputs``) when both fields ask for one."""
    asked = response_format.spec() if response_format is not None else None
    if asked is not None and structured is not None:
        raise FieldError("structured_outputs", "send either response_format or structured_outputs, not both")
    return asked if structured is None else structured.spec()


async def parse_problem(body, tenant: str = "") -> tuple[int, str, str] | None:
    """``(status, field, message)`` when the structured output ``body`` asks for does not parse,
    or not within ``PARSE_TIMEOUT_S`` (400), or ``tenant`` has a parse still running after its
    limit or this spec waited that long for a parsing thread (429); None when it parses or none
    is asked."""
    spec = body.structured()
    if spec is None:
        return None
    by_format = body.structured_outputs is None
    field = "response_format" if by_format else "structured_outputs"
    params = StructuredOutputsParams.of(spec)
    key = (params.kind, params.source())
    too_slow = (f"{field} could not be parsed within {PARSE_TIMEOUT_S:g} s: simplify it (fewer or "
                "smaller repetition counts in its patterns, a smaller schema)")
    if time.monotonic() - _SLOW.get(key, -SLOW_FOR_S) < SLOW_FOR_S:
        return 400, field, too_slow
    if _OVERDUE.get(tenant):
        return 429, field, ("a structured-output spec of this tenant is still being parsed after its "
                            f"{PARSE_TIMEOUT_S:g} s limit: retry once it ends (send simpler specs)")
    if not _parser_imported:                       # seconds, once: not the spec's time
        await asyncio.to_thread(_import_parser)
    cpu: list[float] = []
    job = _PARSERS.submit(_parse, params, cpu)
    try:
        await asyncio.wait_for(asyncio.wrap_future(job), PARSE_TIMEOUT_S)
    except ValueError as e:
        message = str(e)
        return 400, field, message.replace("structured_outputs.json", "json_schema.schema", 1) if by_format else message
    except TimeoutError:
        if job.cancelled():                # still queued behind other specs: this one never ran
            return 429, field, (f"the structured-output parsers are busy with other specs for over "
                                f"{PARSE_TIMEOUT_S:g} s: retry shortly")
        with _STATE_LOCK:                  # refused at once while it runs (and after, if its fault)
            _remember_slow(key)
            _OVERDUE[tenant] = _OVERDUE.get(tenant, 0) + 1
        job.add_done_callback(lambda _: _overrun_ended(tenant, key, cpu))    # in the parsing thread
        return 400, field, too_slow
    return None


def _import_parser() -> None:
    """xgrammar's import (it imports torch: only once a structured request comes)."""
    global _parser_imported
    importlib.import_module("xgrammar")
    _parser_imported = True


def _parse(params: StructuredOutputsParams, cpu: list[float]) -> None:
    """Parse ``params`` (ValueError when it does not); its CPU seconds go to ``cpu``."""
    start = time.thread_time()
    try:
        params.grammar_of()
    finally:
        cpu.append(time.thread_time() - start)


def _remember_slow(key: tuple[str, str]) -> None:
    _SLOW[key] = time.monotonic()
    _SLOW.move_to_end(key)
    while len(_SLOW) > 1024:
        _SLOW.popitem(last=False)


def _overrun_ended(tenant: str, key: tuple[str, str], cpu: list[float]) -> None:
    """A parse that overran its limit ended: its tenant may send specs again, and the spec is
    forgotten when the parse used less CPU than the limit (it waited on the machine)."""
    with _STATE_LOCK:
        left = _OVERDUE.pop(tenant, 1) - 1
        if left:
            _OVERDUE[tenant] = left
        if cpu and cpu[0] < PARSE_TIMEOUT_S:
            _SLOW.pop(key, None)
