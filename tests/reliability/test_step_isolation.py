"""A failed engine step fails the request that caused it, not the batch; and is not retried.

``LLMReplica`` runs outside Serve here (tiny-llama on the CPU). The model runner is made to
fail any step that contains a "poison" prompt (token id 7 first), as a kernel failure on one
request's input would. Requests already decoding keep running and finish whole; the poison
request gets a non-retryable error event. The gateway's half: an event marked
``retryable: false`` or a 4xx event reaches the client once, with no second replica call.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvharbor.actors.replica import LLMReplica
from kvharbor.engine.request import SamplingParams
from kvharbor.platform import generation
from kvharbor.platform.error_body import APIError
from kvharbor.platform.protocol import GenerateRequest

POISON = 7


def _request(rid: str, prompt: list[int], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, tenant="t", qos="standard", prompt_token_ids=prompt,
                           block_hashes=[], sampling={"max_tokens": max_tokens, "temperature": 0,
                                                      "ignore_eos": True})


async def _collect(replica: LLMReplica, request: GenerateRequest, started: asyncio.Event | None = None) -> list[dict]:
    events = []
    async for event in replica.generate(request):
        events.append(event)
        if started is not None and event.get("token_ids"):
            started.set()
    return events


def _poison_runner(replica: LLMReplica) -> list[int]:
    """Make every step that holds a poison prompt raise; returns the count of failed steps."""
    failed = []
    execute = replica.engine.runner.execute

    def guarded(batch):
        if any(item.request.prompt_token_ids[0] == POISON for item in batch):
            failed.append(len(batch))
            raise RuntimeError("kernel failed on this input")
        return execute(batch)

    replica.engine.runner.execute = guarded
    return failed


@pytest.fixture(scope="module")
def replica():
    return LLMReplica({"model": "kvharbor/tiny-llama", "device": "cpu", "num_kv_blocks": 128})


def test_a_poison_request_fails_alone_and_the_batch_finishes(replica):
    failed_steps = _poison_runner(replica)

    async def scenario():
        started = asyncio.Event()
        good = [asyncio.create_task(_collect(replica, _request(f"good-{i}", [20 + i] * 30, 24),
                                             started if i == 0 else None)) for i in range(3)]
        await started.wait()                     # the good ones are decoding
        bad = await _collect(replica, _request("bad", [POISON] + [30] * 40, 8))
        return [await g for g in good], bad

    good, bad = asyncio.run(scenario())
    assert failed_steps, "the poison request never reached a step"
    assert len(bad) == 1 and bad[0]["status"] == 500 and bad[0]["retryable"] is False, bad
    assert bad[0]["code"] == "engine_step_failed"
    for events in good:
        assert "error" not in events[-1], events[-1]
        assert sum(len(e["token_ids"]) for e in events) == 24 and events[-1]["finish_reason"] == "length"
    replica.engine.check_integrity()
    assert not replica.engine.requests


def test_a_request_failing_after_the_forward_fails_alone_and_the_others_lose_no_token(replica, monkeypatch):
    """The failure comes while the engine appends the poison request's sampled token (its
    detokenization here), after the requests before it in the batch got theirs: the poison
    request fails alone and every other stream has each of its tokens, as a run without it."""
    prompts = {f"good-{i}": [60 + i] * 30 for i in range(3)}

    async def run(with_poison: bool):
        started = asyncio.Event()
        good = [asyncio.create_task(_collect(replica, _request(rid, p, 24), started if i == 0 else None))
                for i, (rid, p) in enumerate(prompts.items())]
        await started.wait()
        bad = (await asyncio.wait_for(_collect(replica, _request("late-bad", [POISON + 1] + [30] * 40, 8)), 60)
               if with_poison else None)
        done = await asyncio.wait_for(asyncio.gather(*good), 60)
        return [[t for e in events for t in e.get("token_ids", [])] for events in done], bad

    clean, _ = asyncio.run(run(with_poison=False))
    update = replica.engine.detok.update

    def poisoned(req):
        if req.prompt_token_ids[0] == POISON + 1:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned")
        return update(req)

    monkeypatch.setattr(replica.engine.detok, "update", poisoned)
    good, bad = asyncio.run(run(with_poison=True))
    assert bad == [{"error": "the engine step failed on this request (UnicodeDecodeError); it was not "
                             "retried", "status": 500, "code": "engine_step_failed", "retryable": False}]
    assert good == clean and all(len(ids) == 24 for ids in good)
    replica.engine.check_integrity()
    assert not replica.engine.requests


def test_out_of_vocabulary_ids_are_refused_before_any_step(replica):
    """Refused by ``Engine.add_request``; the replica turns that ValueError into one
    non-retryable 400 event, and the engine holds nothing of the request afterwards."""
    engine = replica.engine
    vocab = engine.model.config.vocab_size
    with pytest.raises(ValueError, match=rf"prompt token ids must be in \[0, {vocab}\)"):
        engine.add_request("oov", [1, vocab], SamplingParams(max_tokens=4))
    assert "oov" not in engine.requests
    events = asyncio.run(asyncio.wait_for(_collect(replica, _request("oov", [1, vocab], 4)), 60))
    assert events == [{"error": f"prompt token ids must be in [0, {vocab})", "status": 400, "retryable": False}]
    assert "oov" not in engine.requests


def test_the_replica_serves_callers_on_a_new_event_loop(replica):
    """Outside Serve a script may call the replica from one ``asyncio.run`` after another: the
    engine loop moves to the new event loop instead of waiting on the closed one forever."""
    for turn in range(2):
        events = asyncio.run(asyncio.wait_for(
            _collect(replica, _request(f"loop-{turn}", [40 + turn] * 20, 3)), 60))
        assert sum(len(e["token_ids"]) for e in events) == 3 and events[-1]["finish_reason"] == "length"


class _FakeStream:
    def __init__(self, events):
        self.events = events

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for e in self.events:
            yield e

    def cancel(self):
        pass


class _FakeLLM:
    """Counts ``generate`` calls; every call answers with ``event`` (or the events of a list)."""

    def __init__(self, event):
        self.events = event if isinstance(event, list) else [event]
        self.calls = 0

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        self.calls += 1
        return _FakeStream(self.events)


@pytest.mark.parametrize("event,status,calls", [
    ({"error": "bad", "status": 400, "retryable": False}, 400, 1),
    ({"error": "step failed on it", "status": 500, "retryable": False, "code": "engine_step_failed"}, 500, 1),
    ({"error": "replica engine failed", "status": 500}, 503, 3),
    # a failure after a token reached the client is not retried: the retry would stream the
    # answer again from its start after the text already sent
    ([{"token_ids": [5], "text": "x", "finish_reason": None},
      {"error": "replica engine failed", "status": 500}], 503, 1),
])
def test_gateway_retries_only_replica_failures(event, status, calls, monkeypatch):
    monkeypatch.setattr(generation, "MAX_ATTEMPTS", 3)
    llm = _FakeLLM(event)
    with pytest.raises(APIError) as info:
        _drain(_gateway_run(llm))
    assert info.value.status == status and llm.calls == calls


def test_each_retry_avoids_every_replica_that_failed_the_request(monkeypatch):
    """The router names the replica it sent the request to (``routed_to``); each retry adds it
    to the replicas the next attempt must avoid."""

    class _RoutingLLM(_FakeLLM):
        def remote(self, request):
            stream = super().remote(request)
            request.metadata["routed_to"] = f"replica-{self.calls}"
            return stream

    monkeypatch.setattr(generation, "MAX_ATTEMPTS", 3)
    llm = _RoutingLLM({"error": "replica engine failed", "status": 500})
    run = _gateway_run(llm)
    with pytest.raises(APIError):
        _drain(run)
    assert llm.calls == 3 and run.reqs[0].metadata["exclude_replicas"] == ["replica-1", "replica-2"]


def test_finish_judges_the_slo_by_the_classs_target_and_releases_what_was_used():
    """Once a request is done the gateway records whether its TTFT met its class's
    ``ttft_slo_ms`` (the SLO-attainment panel) and gives the admission ticket back with the
    prompt and completion tokens it used."""
    recorded, released = [], []

    class Recorder:
        def __getattr__(self, name):
            return lambda *args: recorded.append((name, *args))

    class Admitter:
        async def release(self, ticket, tokens):
            released.append((ticket, tokens))

    gw = SimpleNamespace(llm=None, metrics=Recorder(), ingress="main", admitter=Admitter(),
                         request_done=lambda qos, rid: None)
    principal = SimpleNamespace(qos=SimpleNamespace(ttft_slo_ms=50.0))
    for ttft_s, met in ((0.049, True), (0.051, False)):
        recorded.clear()
        run = generation.GenerationRun(gw, [_request("r", [1, 2, 3], 4)], principal, "ticket",
                                       chat=False, model="m", marks={"arrived": 100.0})
        run.first_token_at, run.choices[0].tokens = 100.0 + ttft_s, 4
        asyncio.run(run.finish())
        assert ("slo", "t", "standard", met) in recorded
        assert released[-1] == ("ticket", 3 + 4)


def test_a_stream_the_replica_ends_without_a_finish_reason_ends_in_abort():
    """The client always sees a finish_reason: a replica stream that stops short (its request
    was dropped there) ends with "abort", as a server-side abort does."""
    llm = _FakeLLM([{"token_ids": [5], "text": "x", "finish_reason": None}])
    events = _drain(_gateway_run(llm, max_tokens=4))
    assert [e["finish_reason"] for e in events] == [None, "abort"] and llm.calls == 1


def _gateway_run(llm, max_tokens: int = 2) -> generation.GenerationRun:
    """The gateway's run of one request whose replica calls go to ``llm`` (a fake handle)."""
    return generation.GenerationRun(SimpleNamespace(llm=llm, metrics=None),
                                    [_request("r", [1, 2], max_tokens)], None, None,
                                    chat=False, model="m")


def _drain(run: generation.GenerationRun) -> list[dict]:
    """Every event of the run's first choice (raises what the run raises)."""

    async def go():
        return [event async for event in run.events()]

    return asyncio.run(go())
