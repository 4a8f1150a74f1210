"""The gateway's parse of a structured-output spec (no Ray): in a worker thread with a time
limit, so a spec that takes long to parse neither stalls the event loop nor holds the request."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError

from kvharbor.engine.structured_output import StructuredOutputsParams
from kvharbor.platform import structured_request
from kvharbor.platform.openai_protocol import ChatRequest, CompletionRequest
from kvharbor.platform.structured_request import ResponseFormat, StructuredOutputs, structured_spec


@pytest.fixture(autouse=True)
def fresh_parser_state(monkeypatch):
    """Each test its own parsing threads and memory of slow specs and overrun tenants."""
    monkeypatch.setattr(structured_request, "_PARSERS", ThreadPoolExecutor(2))
    monkeypatch.setattr(structured_request, "_SLOW", OrderedDict())
    monkeypatch.setattr(structured_request, "_OVERDUE", {})


SLOW = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,2000}"} for i in range(5)}}


def test_a_slow_spec_is_refused_at_the_limit_while_the_loop_runs(monkeypatch):
    monkeypatch.setattr(structured_request, "PARSE_TIMEOUT_S", 0.1)
    body = CompletionRequest(model="m", prompt="x", structured_outputs={"json": SLOW})

    async def run():
        lags, done = [], asyncio.Event()

        async def tick():
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t)
        ticker = asyncio.create_task(tick())
        t = time.perf_counter()
        problem = await structured_request.parse_problem(body)
        took = time.perf_counter() - t
        again = await structured_request.parse_problem(body)      # while the first parse still runs
        took_again = time.perf_counter() - t - took
        done.set()
        await ticker
        return problem, took, lags, again, took_again
    problem, took, lags, again, took_again = asyncio.run(run())
    assert problem is not None and problem[:2] == (400, "structured_outputs") and "within 0.1 s" in problem[2]
    assert took < 0.5 and max(lags) < 0.1 and len(lags) >= 5      # the parse itself takes ~0.7 s here
    assert again == problem and took_again < 0.05                  # refused at once, no second thread


def test_parse_errors_name_the_field_the_client_sent():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], response_format=fmt)
    status, field, message = asyncio.run(structured_request.parse_problem(chat))
    assert (status, field) == (400, "response_format") and message.startswith("json_schema.schema does not compile")
    good = CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "[0-9]+"})
    assert asyncio.run(structured_request.parse_problem(good)) is None


async def _until_parsed(deadline_s: float = 10.0) -> None:
    """Wait (in the loop) until no overrun parse is running."""
    deadline = time.perf_counter() + deadline_s
    while structured_request._OVERDUE and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    assert not structured_request._OVERDUE, "the overrun parse did not end"


def test_a_tenant_whose_parse_overran_waits_for_it_others_do_not(monkeypatch):
    """One tenant's slow specs hold one parsing thread at a time: until its overrun parse ends,
    its structured requests are 429s; another tenant's parse as usual."""
    monkeypatch.setattr(structured_request, "PARSE_TIMEOUT_S", 0.1)
    slow = CompletionRequest(model="m", prompt="x", structured_outputs={"json": SLOW})
    fast = CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "[0-9]+"})

    async def run():
        first = await structured_request.parse_problem(slow, "acme")
        during = [await structured_request.parse_problem(fast, t) for t in ("acme", "globex")]
        await _until_parsed()                               # the overrun parse ends (~0.7 s)
        return first, during, await structured_request.parse_problem(fast, "acme")
    first, (acme, globex), after = asyncio.run(run())
    assert first[0] == 400 and acme[0] == 429 and "still being parsed" in acme[2]
    assert globex is None and after is None and not structured_request._OVERDUE


@pytest.mark.parametrize(("fmt", "says"), [
    ({"type": "text", "json_schema": {"name": "x", "schema": {}}}, "only with it"),
    ({"type": "json_schema"}, "required with type json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema is required"),
], ids=["schema-without-its-type", "type-without-a-schema", "no-schema"])
def test_a_response_format_and_its_schema_go_together(fmt, says):
    with pytest.raises(ValidationError, match=says):
        ResponseFormat(**fmt)


def test_each_request_field_becomes_the_engines_spec():
    schema = {"type": "object"}
    assert ResponseFormat(type="text").spec() is None
    assert ResponseFormat(type="json_object").spec() == {"json_object": True}
    assert ResponseFormat(type="json_schema", json_schema={"name": "x", "schema": schema}).spec() == {"json": schema}
    assert StructuredOutputs(json_object=True, disable_any_whitespace=True).spec() == \
        {"json_object": True, "disable_any_whitespace": True}
    assert StructuredOutputs(choice=["a", "b"]).spec() == {"choice": ["a", "b"], "disable_any_whitespace": False}
    text = ResponseFormat(type="text")
    assert structured_spec(text, StructuredOutputs(regex="[0-9]")) == {"regex": "[0-9]", "disable_any_whitespace": False}
    assert structured_spec(None, None) is None and structured_spec(text, None) is None
    assert asyncio.run(structured_request.parse_problem(CompletionRequest(model="m", prompt="x"))) is None


def test_one_kind_of_structure_per_request():
    with pytest.raises(ValidationError, match="exactly one"):
        StructuredOutputs(regex="[0-9]", choice=["a"])
    with pytest.raises(ValidationError, match="exactly one"):
        StructuredOutputs(disable_any_whitespace=True)
    with pytest.raises(ValueError, match="not both"):
        structured_spec(ResponseFormat(type="json_object"), StructuredOutputs(regex="[0-9]"))
    with pytest.raises(ValidationError, match="not both"):
        CompletionRequest(model="m", prompt="x", response_format={"type": "json_object"},
                          structured_outputs={"regex": "[0-9]"})


def test_a_slow_spec_is_parsed_again_once_its_refusal_expires():
    body = CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "[0-9]+"})
    params = StructuredOutputsParams.of(body.structured())
    key = (params.kind, params.source())
    structured_request._SLOW[key] = time.monotonic() - structured_request.SLOW_FOR_S + 60
    assert asyncio.run(structured_request.parse_problem(body))[0] == 400      # still remembered
    structured_request._SLOW[key] = time.monotonic() - structured_request.SLOW_FOR_S - 1
    assert asyncio.run(structured_request.parse_problem(body)) is None         # parsed again


def test_the_latest_1024_slow_specs_are_remembered():
    for i in range(1024):
        structured_request._remember_slow(("regex", str(i)))
    structured_request._remember_slow(("regex", "0"))              # slow again: now the latest
    structured_request._remember_slow(("regex", "new"))
    slow = structured_request._SLOW
    assert len(slow) == 1024 and ("regex", "1") not in slow
    assert ("regex", "0") in slow and ("regex", "new") in slow


def test_a_tenant_with_two_overrun_parses_waits_for_both():
    structured_request._OVERDUE["acme"] = 2
    structured_request._overrun_ended("acme", ("regex", "a"), [9.0])
    assert structured_request._OVERDUE == {"acme": 1}
    structured_request._overrun_ended("acme", ("regex", "b"), [9.0])
    assert structured_request._OVERDUE == {}


def test_a_parse_the_machine_stalled_is_forgotten_a_slow_spec_is_not(monkeypatch):
    """Past the limit both are refused (400) and, while they run, refused at once. Once they
    end, the spec whose parse used less CPU than the limit (it slept: a stalled machine) parses
    again; the one that computed past the limit stays refused."""
    monkeypatch.setattr(structured_request, "PARSE_TIMEOUT_S", 0.1)
    real = StructuredOutputsParams.grammar_of

    def stalled(self):
        if self.kind == "regex":
            time.sleep(0.4)
        return real(self)
    monkeypatch.setattr(StructuredOutputsParams, "grammar_of", stalled)
    cheap = CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "[0-9]+"})
    slow = CompletionRequest(model="m", prompt="x", structured_outputs={"json": SLOW})

    async def run():
        first = [await structured_request.parse_problem(b, t) for b, t in ((cheap, "acme"), (slow, "globex"))]
        during = [await structured_request.parse_problem(b, "initech") for b in (cheap, slow)]
        await _until_parsed()
        remembered = [kind for kind, _ in structured_request._SLOW]
        monkeypatch.setattr(StructuredOutputsParams, "grammar_of", real)
        return first, during, remembered, [await structured_request.parse_problem(b, "initech") for b in (cheap, slow)]
    first, during, remembered, after = asyncio.run(run())
    assert [p[:2] for p in first + during] == [(400, "structured_outputs")] * 4
    assert remembered == ["json"]                                  # refused without a new parse
    assert after[0] is None and after[1] == first[1]


def test_a_spec_queued_past_the_limit_is_a_retry_not_a_slow_spec(monkeypatch):
    """Both parsing threads busy for longer than the limit: the spec never ran, so it is a 429
    to retry, and it parses once a thread is free."""
    monkeypatch.setattr(structured_request, "PARSE_TIMEOUT_S", 0.1)
    busy = [structured_request._PARSERS.submit(time.sleep, 0.4) for _ in range(2)]
    body = CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "[0-9]+"})
    status, field, message = asyncio.run(structured_request.parse_problem(body, "acme"))
    assert (status, field) == (429, "structured_outputs") and "busy" in message and "retry" in message
    assert not structured_request._SLOW and not structured_request._OVERDUE
    for job in busy:
        job.result()
    assert asyncio.run(structured_request.parse_problem(body, "acme")) is None


def test_the_parsers_first_import_does_not_count_against_the_limit(monkeypatch):
    """xgrammar's import takes seconds the first time (more on a loaded machine): it runs
    before the clock starts, so the first json_object request is not refused as too slow."""
    monkeypatch.setattr(structured_request, "PARSE_TIMEOUT_S", 0.1)
    monkeypatch.setattr(structured_request, "_parser_imported", False)
    monkeypatch.setattr(structured_request, "_import_parser", lambda: time.sleep(0.3))
    body = CompletionRequest(model="m", prompt="x", response_format={"type": "json_object"})
    assert asyncio.run(structured_request.parse_problem(body, "acme")) is None
