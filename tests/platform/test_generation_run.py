"""``GenerationRun`` against fake replicas (no Ray): how a stream that ends early, a sibling's
error and a request's time to first token reach the answer and the metrics."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from kvharbor.platform import generation
from kvharbor.platform.gateway import RunStream
from tests.platform.test_prompt_batches import NoMetrics, Replicas, Stream, _batch


class CutStream(Stream):
    """A replica call whose stream ends after one token, without a finish reason (the replica
    dropped the request)."""

    async def _events(self):
        yield {"token_ids": [7], "text": "a", "finish_reason": None, "replica_id": self.replica}


class FailingStream(Stream):
    """A replica call answered with a non-retryable error event for one sibling."""

    async def _events(self):
        await asyncio.sleep(0.01)
        yield {"error": "this choice's sampling parameters are bad", "status": 400, "retryable": False}


def _run(stream_of, n: int = 1, principal=None, tool_mode: str | None = None, chat: bool = False,
         logprobs: int | None = None, reasoning: tuple[str, bool, bool] | None = None,
         one_call: bool = False, **gateway) -> generation.GenerationRun:
    """A run of ``n`` choices of one prompt; each replica call answers with the ``Stream``
    class ``stream_of(request)`` returns. ``gateway``: fields of the fake gateway (metrics
    default to none). ``tool_mode``: a chat run calling that function (or ``required``);
    ``chat``: a chat run without tools; ``logprobs``: the request's (the fake gateway then
    needs a ``tokenizer``); ``reasoning``: the run's reasoning parser, thinking switch and include_reasoning;
    ``one_call``: ``parallel_tool_calls`` false."""
    replicas = Replicas()
    replicas.remote = lambda request, replica_id=None: stream_of(request)(replicas.log, request,
                                                                          replica_id or "replica-0")
    gw = SimpleNamespace(**{"llm": replicas, "metrics": NoMetrics(), **gateway})
    principal = principal or _principal()
    return generation.GenerationRun(gw, _batch([[1, 2, 3]], n=n), principal, None, chat=chat or tool_mode is not None,
                                    model="m", logprobs=logprobs, tool_mode=tool_mode, reasoning=reasoning,
                                    one_call=one_call)


def _principal(slo_ms: float | None = None) -> SimpleNamespace:
    """A tenant of class standard, running at it (what a run reads of a principal)."""
    return SimpleNamespace(qos=SimpleNamespace(ttft_slo_ms=slo_ms), qos_name="standard",
                           config=SimpleNamespace(qos="standard"))


def _answering_run(stream_of, slo_ms: float | None = None, **kw) -> generation.GenerationRun:
    """``_run`` with the fake gateway's fields that a run's ``finish`` needs (admission
    release, request bookkeeping, the principal's class SLO ``slo_ms``)."""
    async def release(ticket, tokens):
        return None

    return _run(stream_of, principal=_principal(slo_ms), ingress="main",
                request_done=lambda qos, rid: None, admitter=SimpleNamespace(release=release), **kw)


def _events_of(run: generation.GenerationRun) -> tuple[list, BaseException | None]:
    """``(choice index, text, finish reason)`` of every event, and the error that ended them."""
    events: list = []

    async def go():
        async for index, event in run.all_events():
            events.append((index, event.get("text"), event.get("finish_reason")))

    try:
        asyncio.run(go())
    except Exception as e:  # noqa: BLE001 - returned to the test
        return events, e
    return events, None


def test_a_stream_the_replica_ends_early_finishes_its_choice_as_aborted():
    events, error = _events_of(_run(lambda request: CutStream))
    assert error is None and events == [(0, "a", None), (0, "", "abort")]


def test_a_named_function_call_the_server_aborted_answers_its_text_not_a_call():
    """Arguments cut by ``max_tokens`` are still the call (finish ``length``, as vLLM answers);
    a request the server stopped (finish ``abort``) answers the text it had as content, with
    no call made of it."""
    aborted = asyncio.run(_answering_run(lambda request: CutStream, tool_mode="get_weather").complete())
    message = aborted["choices"][0]["message"]
    assert aborted["choices"][0]["finish_reason"] == "abort"
    assert message["content"] == "a" and "tool_calls" not in message
    cut = asyncio.run(_answering_run(lambda request: SlowStream, tool_mode="get_weather").complete())
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "a"}


def test_a_streamed_list_of_calls_cut_by_max_tokens_ends_as_its_text():
    """Streamed ``required``: nothing until the choice ends; then a list of calls cut short
    (not JSON) comes as the text it is, finish ``length``, and the stream ends cleanly."""
    async def chunks():
        return [c async for c in _answering_run(lambda request: SlowStream, tool_mode="required").stream_chunks(False)]

    out = asyncio.run(chunks())
    assert out[-1] == "[DONE]" and not any("error" in c for c in out[:-1]), out
    last = out[-2]["choices"][0]
    assert last["delta"] == {"content": "a"} and last["finish_reason"] == "length", out


def test_one_siblings_error_fails_the_whole_request():
    """``n`` = 2, the second choice's call is refused (400): the request fails with that error
    instead of answering the first choice alone."""
    events, error = _events_of(_run(lambda request: FailingStream if request.request_id == "r-1" else Stream, n=2))
    assert isinstance(error, generation.APIError) and error.status == 400, (events, error)
    assert "sampling parameters are bad" in error.message


class SlowStream(Stream):
    """The first token 50 ms after the call."""

    async def _events(self):
        await asyncio.sleep(0.05)
        yield {"token_ids": [7], "text": "a", "finish_reason": "length", "replica_id": self.replica}


def test_a_first_token_later_than_the_class_slo_counts_as_missed():
    """``kvharbor_slo_requests_total`` gets ``missed`` when the first token came after the
    class's ``ttft_slo_ms`` (50 ms against 20) and ``met`` when before."""
    def outcomes(slo_ms: float) -> list[bool]:
        seen: list[bool] = []
        metrics = SimpleNamespace(slo=lambda tenant, qos, met: seen.append(met),
                                  **{name: (lambda *args: None) for name in (
                                      "request_finished", "request_latency", "tokens", "ttft")})
        asyncio.run(_answering_run(lambda request: SlowStream, slo_ms, metrics=metrics).complete())
        return seen

    assert outcomes(20.0) == [False]
    assert outcomes(5000.0) == [True]


def test_inter_token_latency_is_per_token_when_an_event_carries_several(monkeypatch):
    """A streamed chunk of 4 tokens 40 ms after the one before records 10 ms per token (the
    dashboards' ITL), not 40. The clock is the test's."""
    clock = [100.0]
    monkeypatch.setattr(generation, "time", SimpleNamespace(perf_counter=lambda: clock[0], time=lambda: 0.0))

    class Chunked(Stream):
        async def _events(self):
            yield {"token_ids": [7], "text": "a", "finish_reason": None, "replica_id": self.replica}
            clock[0] += 0.040
            yield {"token_ids": [7, 8, 9, 10], "text": "bcde", "finish_reason": "length"}

    gaps: list[float] = []
    metrics = SimpleNamespace(inter_token_latency=lambda tenant, qos, seconds: gaps.append(seconds))
    events, error = _events_of(_run(lambda request: Chunked, metrics=metrics))
    assert error is None and len(events) == 2
    assert gaps == [pytest.approx(0.010)]


class LateFailingStream(Stream):
    """A replica call that streams two tokens, then a non-retryable error event."""

    async def _events(self):
        yield {"token_ids": [7], "text": "a", "finish_reason": None, "replica_id": self.replica}
        yield {"token_ids": [8], "text": "b", "finish_reason": None}
        yield {"error": "the engine refused to go on", "status": 400, "retryable": False}


def _served(run: generation.GenerationRun) -> tuple[int, list[str]]:
    """``run`` streamed through ``RunStream`` to a client that stays: the HTTP status and the
    body's SSE ``data`` payloads (or the whole body, when it is not SSE)."""
    sent: list[dict] = []

    async def receive():
        await asyncio.Event().wait()

    async def send(message: dict) -> None:
        sent.append(message)

    async def serve() -> None:
        response = RunStream(run, generation.sse(run.stream_chunks(False)))
        await asyncio.wait_for(response({"type": "http", "path": "/v1/completions"}, receive, send), timeout=10)

    asyncio.run(serve())
    body = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    events = [part.removeprefix("data: ") for part in body.split("\n\n") if part]
    return sent[0]["status"], events


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_stream_refused_before_its_first_token_answers_with_the_errors_status(chat):
    """The replica refuses the request (400) before any token: the client gets HTTP 400 and
    the OpenAI error body, as an unstreamed request does (and vLLM for a stream's invalid
    request), not a 200 stream that carries the error, nor a chat role chunk before it."""
    status, body = _served(_answering_run(lambda request: FailingStream, chat=chat))
    assert status == 400, body
    error = json.loads(body[0])["error"]
    assert error["message"] == "this choice's sampling parameters are bad" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_an_error_after_the_first_token_ends_the_200_stream_with_an_error_event(chat):
    """Once a token went out the status is sent: the error comes as the stream's last event
    before ``[DONE]``, after the tokens (and, for chat, after the one role chunk that came
    with the first)."""
    status, events = _served(_answering_run(lambda request: LateFailingStream, chat=chat))
    assert status == 200 and events[-1] == "[DONE]", events
    assert json.loads(events[-2])["error"]["message"] == "the engine refused to go on"
    chunks = [json.loads(e)["choices"][0] for e in events[:-2]]
    if chat:
        assert [c["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]
    else:
        assert [c["text"] for c in chunks] == ["a", "b"]
