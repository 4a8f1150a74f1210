"""The gateway's parse of a structured-output spec (no Ray): in a worker thread with a time
limit, so a spec that takes long to parse neither stalls the event loop nor holds the request."""

from __future__ import annotations

import asyncio
import time

from kvharbor.platform import structured_request
from kvharbor.platform.openai_protocol import ChatRequest, CompletionRequest

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
    assert problem is not None and problem[0] == "structured_outputs" and "within 0.1 s" in problem[1]
    assert took < 0.5 and max(lags) < 0.1 and len(lags) >= 5      # the parse itself takes ~0.7 s here
    assert again == problem and took_again < 0.05                  # refused at once, no second thread


def test_parse_errors_name_the_field_the_client_sent():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], response_format=fmt)
    field, message = asyncio.run(structured_request.parse_problem(chat))
    assert field == "response_format" and message.startswith("json_schema.schema does not compile")
    good = CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "[0-9]+"})
    assert asyncio.run(structured_request.parse_problem(good)) is None
