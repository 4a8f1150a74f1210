"""A class's stream_interval: tokens per streamed event, with the first token and the end at once."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from kvharbor.actors.replica import LLMReplica
from kvharbor.actors.stream_events import coalesced
from kvharbor.platform.protocol import GenerateRequest
from kvharbor.tenants.schema import QoSClassConfig
from tests.conftest import DEMO


def _token(i: int, last: bool = False, **extra) -> dict:
    return {"token_ids": [i], "text": f"<{i}>", "finish_reason": "length" if last else None, **extra}


def _run(events: list[dict], interval: int, arrive_together: bool = False) -> list[dict]:
    """Events out of ``coalesced`` when ``events`` arrive one at a time (the reader waiting on
    each) or all queued before the reader looks."""
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        out = []

        async def read():
            async for event in coalesced(queue, interval):
                out.append(event)

        reader = asyncio.create_task(read())
        for event in events:
            queue.put_nowait(event)
            if not arrive_together:
                await asyncio.sleep(0)          # the reader takes it before the next arrives
        await asyncio.wait_for(reader, 5)
        return out

    return asyncio.run(scenario())


def test_first_token_goes_alone_then_interval_tokens_then_the_end():
    events = [_token(0, replica_ms=3.0)] + [_token(i) for i in range(1, 9)] + [_token(9, last=True)]
    out = _run(events, interval=4)
    assert [e["token_ids"] for e in out] == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert [e["finish_reason"] for e in out] == [None, None, None, "length"]
    assert "".join(e["text"] for e in out) == "".join(f"<{i}>" for i in range(10))
    assert out[0]["replica_ms"] == 3.0 and all("replica_ms" not in e for e in out[1:])


def test_interval_one_sends_every_token_and_zero_holds_the_rest_to_the_end():
    events = [_token(i) for i in range(5)] + [_token(5, last=True)]
    assert [e["token_ids"] for e in _run(events, interval=1)] == [[i] for i in range(6)]
    assert [e["token_ids"] for e in _run(events, interval=0)] == [[0], [1, 2, 3, 4, 5]]


def test_a_backlog_goes_as_one_event_and_keeps_logprobs_in_order():
    events = [_token(i, logprobs=[(-float(i), {})]) for i in range(4)] + [_token(4, last=True, logprobs=[(-4.0, {})])]
    out = _run(events, interval=1, arrive_together=True)
    assert [e["token_ids"] for e in out] == [[0, 1, 2, 3, 4]]
    assert [lp for lp, _ in out[0]["logprobs"]] == [0.0, -1.0, -2.0, -3.0, -4.0]


def test_the_final_event_is_not_merged_with_an_abort_queued_behind_it():
    """``abort()`` racing the request's own end queues an abort event after the final one: the
    stream ends with the request's own finish reason and tokens, and nothing after them."""
    abort = {"token_ids": [], "text": "", "finish_reason": "abort"}
    out = _run([_token(0), _token(1), _token(2, last=True), abort], interval=8, arrive_together=True)
    assert [e["token_ids"] for e in out] == [[0, 1, 2]]
    assert out[-1]["finish_reason"] == "length"


def test_an_event_without_tokens_is_not_sent_as_the_first_token():
    empty = {"token_ids": [], "text": "", "finish_reason": None}
    out = _run([empty, _token(0), _token(1), _token(2, last=True)], interval=8)
    assert [e["token_ids"] for e in out] == [[0], [1, 2]]


def test_an_error_flushes_what_is_held_then_ends_the_stream():
    error = {"error": "replica engine failed", "status": 500}
    out = _run([_token(0), _token(1), _token(2), error, _token(3)], interval=8)
    assert out == [_token(0), {**_token(1), "token_ids": [1, 2], "text": "<1><2>"}, error]


def test_stream_interval_must_be_positive():
    assert QoSClassConfig(priority=1).stream_interval == 1
    with pytest.raises(ValidationError, match="stream_interval"):
        QoSClassConfig(priority=1, stream_interval=0)


def _req(rid: str, interval: int, max_tokens: int = 11) -> GenerateRequest:
    return GenerateRequest(request_id=rid, tenant="t", qos="batch", prompt_token_ids=[5 + i for i in range(30)],
                           block_hashes=[], stream_interval=interval,
                           sampling={"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})


def test_replica_streams_the_same_tokens_in_interval_sized_events():
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64})

    async def collect(request):
        return [event async for event in replica.generate(request)]

    every = asyncio.run(collect(_req("every", 1)))
    chunked = asyncio.run(collect(_req("chunked", 4)))
    whole = asyncio.run(collect(_req("whole", 0)))
    assert [len(e["token_ids"]) for e in every] == [1] * 11
    assert [len(e["token_ids"]) for e in chunked] == [1, 4, 4, 2]
    assert [len(e["token_ids"]) for e in whole] == [1, 10]
    ids = [t for e in every for t in e["token_ids"]]
    assert [t for e in chunked for t in e["token_ids"]] == ids == [t for e in whole for t in e["token_ids"]]
    assert "".join(e["text"] for e in chunked) == "".join(e["text"] for e in every)
    assert chunked[-1]["finish_reason"] == "length" and chunked[-1]["num_output_tokens"] == 11
    assert "replica_ms" in chunked[0]
    replica.engine.check_integrity()



def test_each_event_carries_the_reasoning_count_so_far():
    """With a reasoning parser, every event has the engine's count of thinking tokens so far
    (vLLM's continuous usage shows reasoning_tokens growing), not only the last one. The tiny
    model never writes </think>: all its tokens are reasoning."""
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64, "reasoning_parser": "deepseek_r1"})

    async def collect(request):
        return [event async for event in replica.generate(request)]

    events = asyncio.run(collect(_req("thinking", 2, max_tokens=7)))
    assert [e.get("num_reasoning_tokens") for e in events] == [1, 3, 5, 7]

def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.split("\n\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_batch_class_streams_in_chunks_and_counts_tokens_per_chunk(kvharbor_app):
    """The shipped tenants.yaml gives batch stream_interval 16 and premium 1; continuous usage
    lets a client count the tokens of each chunk."""
    body = {"model": kvharbor_app.model, "prompt": "Tides and ships", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    texts, counts = {}, {}
    for qos in ("batch", "premium"):
        with kvharbor_app.client(DEMO[qos]) as c:
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        chunks = [d for d in _sse(r.text) if d.get("choices")]
        assert all("usage" in d for d in chunks)
        counts[qos] = [d["usage"]["completion_tokens"] for d in chunks]
        texts[qos] = "".join(d["choices"][0]["text"] for d in chunks)
    for qos, interval in (("batch", 16), ("premium", 1)):
        sizes = [b - a for a, b in zip([0] + counts[qos], counts[qos])]
        assert sizes[0] == 1 and sum(sizes) == 40, (qos, sizes)
        # a backlog may make a chunk bigger, never smaller (only the last may be short)
        assert all(size >= interval for size in sizes[1:-1]), (qos, sizes)
    assert len(counts["batch"]) <= 4 < len(counts["premium"])
    assert texts["batch"] == texts["premium"]


def test_continuous_usage_needs_include_usage(kvharbor_app):
    """As in vLLM, ``continuous_usage_stats`` adds usage to every chunk only with
    ``include_usage``: alone it sends no usage at all."""
    body = {"model": kvharbor_app.model, "prompt": "Tides and ships", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    with kvharbor_app.client(DEMO["premium"]) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    events = _sse(r.text)
    assert sum(len(d["choices"][0]["text"]) > 0 for d in events if d.get("choices")) >= 1
    assert not any(d.get("usage") for d in events), events
