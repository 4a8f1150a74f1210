"""Direct streams (kvharbor.platform.direct_stream): a pinned request's events over one TCP
connection from the gateway to its replica (the router's side: test_direct_stream_routing)."""

from __future__ import annotations

import asyncio
import json
import pickle
import time

import pytest

from kvharbor.platform.direct_stream import (HEADER, MAX_REQUEST_BYTES, TOKEN_BYTES, DirectStream,
                                             DirectStreamFailed, DirectStreamServer, _frame)
from kvharbor.platform.protocol import GenerateRequest
from tests.platform.test_router_unit import PROMPT

UNPICKLED: list[str] = []


def _unpickled(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class Marker:
    """Records that something unpickled it."""

    def __reduce__(self):
        return _unpickled, ("marker",)


def _req(rid: str = "r", hashes=()) -> GenerateRequest:
    return GenerateRequest(request_id=rid, tenant="acme", qos="premium", prompt_token_ids=PROMPT,
                           block_hashes=list(hashes), sampling={}, pinned=True)


class Replica:
    """A replica's generate(): ``n`` token events and a last one; ``hold`` waits after the
    first event until cancelled. ``closed`` records (request id, finished) as generate's
    ``finally`` sees it: finished False is the abort a vanished caller causes."""

    def __init__(self, n: int = 3, hold: bool | asyncio.Event = False) -> None:
        self.n, self.hold = n, hold       # an Event: wait for it after the first event
        self.seen: list[str] = []
        self.closed: list[tuple[str, bool]] = []

    async def generate(self, request: GenerateRequest):
        self.seen.append(getattr(request, "request_id", request))
        finished = False
        try:
            for i in range(self.n):
                yield {"token_ids": [i], "finish_reason": None}
                if isinstance(self.hold, asyncio.Event):
                    if i == 0:
                        await self.hold.wait()
                elif self.hold:
                    await asyncio.Event().wait()
            yield {"token_ids": [], "finish_reason": "length"}
            finished = True
        finally:
            self.closed.append((request.request_id, finished))


def _no_fallback():
    raise AssertionError("fell back to Serve's path")


async def _until(check, timeout_s: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _served(replica: Replica, done: list) -> tuple[DirectStreamServer, DirectStream]:
    """A listening server for ``replica`` and a stream routed to it as replica "rep-1"."""
    server = DirectStreamServer(replica.generate, "127.0.0.1")
    await server.start()

    async def route(request):
        return "rep-1", server.address

    return server, DirectStream(route, done.append, _req(), _no_fallback)


def test_the_events_arrive_in_order_and_the_stream_is_reported_ended_once():
    replica, done = Replica(3), []

    async def main():
        server, stream = await _served(replica, done)
        events = [e async for e in stream]
        stream.cancel()                           # after the end: nothing more to report
        server.close()
        return stream, events

    stream, events = asyncio.run(main())
    assert [e["token_ids"] for e in events] == [[0], [1], [2], []]
    assert events[-1]["finish_reason"] == "length"
    assert replica.seen == ["r"] and replica.closed == [("r", True)]
    assert done == ["rep-1"] and stream.replica == "rep-1"


def test_cancelling_the_stream_aborts_the_request_on_the_replica():
    replica, done = Replica(3, hold=True), []

    async def main():
        server, stream = await _served(replica, done)
        events = aiter(stream)
        first = await anext(events)
        stream.cancel()                           # the client went away
        await _until(lambda: replica.closed)
        rest = [e async for e in events]          # ends quietly: it was cancelled
        server.close()
        return first, rest

    first, rest = asyncio.run(main())
    assert first["token_ids"] == [0] and rest == []
    assert replica.closed == [("r", False)]       # generate's finally ran unfinished: aborted
    assert done == ["rep-1"]


def test_a_wrong_token_is_refused_before_anything_is_unpickled():
    replica = Replica()
    UNPICKLED.clear()

    async def main():
        server = DirectStreamServer(replica.generate, "127.0.0.1")
        await server.start()
        host, port, token = server.address
        answers = []
        for sent_token in (bytes(TOKEN_BYTES), bytes.fromhex(token)):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(sent_token + _frame(pickle.dumps(Marker())))
            await writer.drain()
            answers.append(await asyncio.wait_for(reader.read(), 3))   # b"": closed on us
            writer.close()
        server.close()
        return answers

    answers = asyncio.run(main())
    assert answers == [b"", b""]
    # The wrong token: closed unread. The right one: read, and refused as no GenerateRequest.
    assert UNPICKLED == ["marker"] and replica.seen == []


def test_a_request_frame_over_the_limit_is_refused_unread():
    """With the right token, a frame announcing more than MAX_REQUEST_BYTES is refused from
    its 4-byte header: the connection closes without the replica waiting for (or allocating)
    the body, and nothing is generated."""
    replica = Replica()

    async def main():
        server = DirectStreamServer(replica.generate, "127.0.0.1")
        await server.start()
        host, port, token = server.address
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(bytes.fromhex(token) + HEADER.pack(MAX_REQUEST_BYTES + 1) + b"x" * 1024)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 3)            # b"": closed on us
        writer.close()
        server.close()
        return answer, server.open_streams

    assert asyncio.run(main()) == (b"", 0)
    assert replica.seen == []


def test_a_replica_that_dies_mid_stream_or_cannot_be_reached_fails_the_stream():
    async def dying(reader, writer):              # answers one event, then goes away
        await reader.readexactly(TOKEN_BYTES)
        size = int.from_bytes(await reader.readexactly(4), "big")
        await reader.readexactly(size)
        writer.write(_frame(pickle.dumps({"token_ids": [5]})))
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(dying, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        token = bytes(TOKEN_BYTES).hex()
        got, done = [], []

        async def to(p):
            async def route(request):
                return "rep-1", ["127.0.0.1", p, token]
            return route

        with pytest.raises(DirectStreamFailed, match="closed the stream before its end"):
            async for event in DirectStream(await to(port), done.append, _req(), _no_fallback):
                got.append(event)
        server.close()
        await server.wait_closed()
        with pytest.raises(DirectStreamFailed, match="could not reach replica rep-1"):
            async for event in DirectStream(await to(port), done.append, _req(), _no_fallback):
                got.append(event)
        return got, done

    got, done = asyncio.run(main())
    assert got == [{"token_ids": [5]}]
    assert done == ["rep-1", "rep-1"]
    assert issubclass(DirectStreamFailed, ConnectionError)     # the gateway retries these


def test_without_a_direct_route_the_stream_is_serves():
    class ServeStream:
        cancelled = False

        def __aiter__(self):
            return self._events()

        async def _events(self):
            yield {"token_ids": [7]}

        def cancel(self):
            self.cancelled = True

    serve_stream, done = ServeStream(), []

    async def no_route(request):
        return None

    async def main():
        stream = DirectStream(no_route, done.append, _req(), lambda: serve_stream)
        events = [e async for e in stream]
        stream.cancel()
        return events

    assert asyncio.run(main()) == [{"token_ids": [7]}]
    assert serve_stream.cancelled and done == []


class _Handle:
    """What GenerationRun._call reads of the gateway's LLM handle; records Serve calls."""

    deployment_name, app_name = "LLMReplica", "kvharbor"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def options(self, **kwargs):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request, **kwargs):
        self.calls.append((request.request_id, kwargs))
        return "serve-stream"


@pytest.mark.parametrize("pinned, switch, router, direct", [
    (True, True, True, True), (True, False, True, False), (False, True, True, False),
    (True, True, False, False)])
def test_a_choice_streams_direct_only_for_a_pinned_class_with_the_switch_on_and_a_router(
        monkeypatch, pinned, switch, router, direct):
    from types import SimpleNamespace

    from kvharbor.platform.generation import GenerationRun
    from kvharbor.platform.router import KVAwareRouter

    fake_router = SimpleNamespace(route_direct=lambda *a, **k: None, direct_done=print)
    monkeypatch.setattr(KVAwareRouter, "for_handle",
                        classmethod(lambda cls, handle: fake_router if router else None))
    gw = SimpleNamespace(llm=_Handle(), config={"direct_streams": switch})
    run = GenerationRun.__new__(GenerationRun)
    request = _req()
    request.pinned = pinned
    run.gw, run.reqs, run.per_prompt, run._replica_of = gw, [request], 1, {}
    stream = run._call(0)
    assert isinstance(stream, DirectStream) is direct
    assert gw.llm.calls == ([] if direct else [("r", {})])


def test_premium_tokens_come_direct_and_equal_those_serves_path_gives(kvharbor_app):
    """Through the app: every premium request (main port, premium lane, streamed or not) is
    served over a direct stream, a standard one through Serve, with the same greedy tokens."""
    from tests.conftest import DEMO

    body = {"model": kvharbor_app.model, "prompt": "Ships at anchor in the harbor",
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    deadline = time.monotonic() + 15        # a new app's replicas report their port within 1 s
    with kvharbor_app.client(DEMO["premium"]) as c:
        while c.post("/v1/completions", json=body).json()["kvharbor"]["transport"] != "direct":
            assert time.monotonic() < deadline, "no premium request was served direct"
            time.sleep(0.2)
    seen = {}
    for qos, lane in (("premium", False), ("premium", True), ("standard", False)):
        for attempt in range(3):
            with kvharbor_app.client(DEMO[qos], lane=lane) as c:
                whole = c.post("/v1/completions", json=body)
                with c.stream("POST", "/v1/completions", json={
                        **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                    chunks = [json.loads(line[6:]) for line in r.iter_lines()
                              if line.startswith("data: {")]
            assert whole.status_code == 200 and r.status_code == 200, whole.text
            streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            seen[qos, lane, attempt] = (whole.json()["kvharbor"]["transport"],
                                        chunks[-1]["kvharbor"]["transport"],
                                        whole.json()["choices"][0]["text"], streamed)
    texts = {v[2] for v in seen.values()} | {v[3] for v in seen.values()}
    assert len(texts) == 1, seen
    for (qos, _, _), (whole_via, stream_via, _, _) in seen.items():
        expected = "direct" if qos == "premium" else "serve"
        assert (whole_via, stream_via) == (expected, expected), seen


def test_a_stream_cancelled_before_it_is_routed_sends_nothing():
    calls, done = [], []

    def fallback():
        calls.append("serve")
        raise AssertionError("a cancelled stream called Serve")

    async def no_route(request):
        return None

    async def routed(request):
        return "rep-1", ["127.0.0.1", 1, bytes(TOKEN_BYTES).hex()]   # nothing listens there

    async def main():
        for choose in (no_route, routed):
            stream = DirectStream(choose, done.append, _req(), fallback)
            stream.cancel()                       # the client left while the router decided
            assert [e async for e in stream] == []

    asyncio.run(main())
    assert calls == [] and done == ["rep-1"]      # the routed send is booked back once


def test_the_gateway_starts_its_handles_request_router_before_the_first_request():
    from kvharbor.platform.direct_stream import start_request_router

    class Handle:
        def __init__(self, initialized=False, fails=False):
            self.is_initialized, self.fails, self.inits = initialized, fails, 0

        def _init_router(self):
            self.inits += 1
            if self.fails:
                raise RuntimeError("not under Serve")

    fresh, started, failing = Handle(), Handle(initialized=True), Handle(fails=True)
    for handle in (fresh, started, failing, object()):
        start_request_router(handle)           # never raises
    assert (fresh.inits, started.inits, failing.inits) == (1, 0, 1)


async def _route(address):
    return "rep-1", address


def replica_request(rid: str, max_tokens: int) -> GenerateRequest:
    """A greedy premium request (37 prompt tokens, ``max_tokens`` out) for a real replica."""
    return GenerateRequest(request_id=rid, tenant="acme", qos="premium", pinned=True,
                           prompt_token_ids=list(range(3, 40)), block_hashes=[],
                           sampling={"max_tokens": max_tokens, "temperature": 0.0,
                                     "ignore_eos": True})


def _direct_to(stats: dict, request: GenerateRequest) -> DirectStream:
    """A direct stream of ``request`` to the replica whose routing stats are ``stats``."""
    return DirectStream(lambda _: _route(stats["direct"]), lambda uid: None, request,
                        _no_fallback)


def test_a_replica_publishes_its_address_and_serves_the_tokens_generate_gives():
    """LLMReplica without Serve: the routing stats carry the address; a direct stream's
    tokens equal a generate() call's; a replica that cannot listen still reports its stats."""
    from kvharbor.actors.replica import LLMReplica

    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64}, direct_streams=True)

    async def main():
        stats = await replica.record_routing_stats()
        request = replica_request("d", 6)
        direct = [e async for e in _direct_to(stats, request)]
        request.request_id = "g"
        local = [e async for e in replica.generate(request)]
        return stats, direct, local

    stats, direct, local = asyncio.run(main())
    host, port, token = stats["direct"]
    assert host == "127.0.0.1" and port > 0 and len(bytes.fromhex(token)) == TOKEN_BYTES
    tokens = lambda events: [t for e in events for t in e["token_ids"]]   # noqa: E731
    assert len(tokens(direct)) == 6 and tokens(direct) == tokens(local)
    assert direct[-1]["finish_reason"] == "length"

    async def refused(*args, **kwargs):
        raise OSError("address in use")

    broken = LLMReplica({"device": "cpu", "num_kv_blocks": 64}, direct_streams=True)
    broken._direct.start = refused
    stats = asyncio.run(broken.record_routing_stats())
    assert stats["direct"] is None and stats["total_blocks"] == 64


def test_draining_refuses_new_streams_and_lets_the_open_ones_finish():
    """``drain``: the listener closes at once (a gateway that still picks this replica is
    refused and retries elsewhere), the open stream runs to its end, and only then does
    ``drain`` return; a stream that outlasts the timeout is counted as left open."""

    async def main():
        release = asyncio.Event()
        replica, done = Replica(3, hold=release), []
        server, stream = await _served(replica, done)
        events = aiter(stream)
        first = await anext(events)
        address = server.address
        drain = asyncio.ensure_future(server.drain(5.0))
        await asyncio.sleep(0.2)
        assert not drain.done(), "drain returned while a stream was open"
        late = DirectStream(lambda _: _route(address), done.append, _req("late"), _no_fallback)
        with pytest.raises(DirectStreamFailed):
            await asyncio.wait_for(_all(late), 2.0)
        release.set()
        rest = [e async for e in events]
        left = await asyncio.wait_for(drain, 2.0)
        stuck_replica = Replica(3, hold=True)
        stuck, stuck_stream = await _served(stuck_replica, [])
        stuck_events = aiter(stuck_stream)       # held: a dropped iterator closes the stream
        await anext(stuck_events)
        stuck_left = await stuck.drain(0.2)
        stuck_stream.cancel()
        return first, rest, left, replica, stuck_left

    first, rest, left, replica, stuck_left = asyncio.run(main())
    assert [first["token_ids"]] + [e["token_ids"] for e in rest] == [[0], [1], [2], []]
    assert rest[-1]["finish_reason"] == "length" and replica.closed == [("r", True)]
    assert replica.seen == ["r"], "the late stream reached generate()"
    assert left == 0 and stuck_left == 1




def test_a_replica_shut_down_with_open_direct_streams_finishes_them_first():
    """``LLMReplica.__del__`` (what Serve calls to stop a replica, awaiting what it returns):
    with a direct stream open it returns a coroutine that lets the stream end with all its
    tokens before the replica's step thread stops; with none open it shuts down at once."""
    from kvharbor.actors.replica import LLMReplica

    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64}, direct_streams=True)

    async def main():
        stats = await replica.record_routing_stats()
        events = aiter(_direct_to(stats, replica_request("d", 48)))
        first = await anext(events)
        shutdown = replica.__del__()
        assert shutdown is not None, "shut down with a direct stream open"
        rest, _ = await asyncio.gather(_all(events), shutdown)
        return [first] + rest

    events = asyncio.run(main())
    assert sum(len(e["token_ids"]) for e in events) == 48
    assert events[-1]["finish_reason"] == "length"
    assert replica._step_pool._shutdown and replica._direct.open_streams == 0
    idle = LLMReplica({"device": "cpu", "num_kv_blocks": 16}, direct_streams=True)
    assert idle.__del__() is None and idle._step_pool._shutdown


async def _all(events) -> list:
    return [e async for e in events]
