"""The gateway's parse of a structured-output spec (no Ray): in a worker thread with a time
limit, so a spec that takes long to parse neither stalls the event loop nor holds the request."""

from __future__ import annotations

import asyncio
import time

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvharbor.platform import structured_request
from kvharbor.platform.openai_protocol import ChatRequest, CompletionRequest

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


def test_a_tenant_whose_parse_overran_waits_for_it_others_do_not(monkeypatch):
    """One tenant's slow specs hold one parsing thread at a time: until its overrun parse ends,
    its structured requests are 429s; another tenant's parse as usual."""
    monkeypatch.setattr(structured_request, "PARSE_TIMEOUT_S", 0.1)
    slow = CompletionRequest(model="m", prompt="x", structured_outputs={"json": SLOW})
    fast = CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "[0-9]+"})

    async def run():
        first = await structured_request.parse_problem(slow, "acme")
        during = [await structured_request.parse_problem(fast, t) for t in ("acme", "globex")]
        deadline = time.perf_counter() + 10
        while structured_request._OVERDUE and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)                       # the overrun parse ends (~0.7 s)
        return first, during, await structured_request.parse_problem(fast, "acme")
    first, (acme, globex), after = asyncio.run(run())
    assert first[0] == 400 and acme[0] == 429 and "still being parsed" in acme[2]
    assert globex is None and after is None and not structured_request._OVERDUE
