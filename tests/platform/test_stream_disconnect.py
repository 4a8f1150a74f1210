"""A client that closes a stream behind Serve's proxy ends the stream quietly.

Behind Serve's proxy the gateway reads the client's messages through an actor call to the
proxy; when the client closes, the proxy cancels that call and ``receive`` raises
``TaskCancelledError`` instead of returning ``http.disconnect``. Seen in the gateway's logs
of the test session: "unexpected error on /v1/completions" with that stack trace, from the
500 handler, for a client that had simply gone away.
"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import TaskCancelledError

from kvharbor.platform.gateway import RunStream


class FakeRun:
    """Stands in for ``GenerationRun``: counts how it was settled."""

    def __init__(self) -> None:
        self.cancelled = 0
        self.finished = 0

    def cancel(self) -> None:
        self.cancelled += 1

    async def finish(self) -> None:
        self.finished += 1


def _stream_closed_by(error: BaseException | None, run: FakeRun) -> list[dict]:
    """Serve one endless stream whose ``receive`` fails with ``error`` after the first chunk
    (or returns ``http.disconnect`` when ``error`` is None)."""
    sent = []
    first_chunk_sent = asyncio.Event()

    async def chunks():
        yield "data: 1\n\n"
        await asyncio.sleep(3600)                 # the engine would go on; the client will not

    async def receive():
        await first_chunk_sent.wait()
        if error is not None:
            raise error
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message.get("body"):
            first_chunk_sent.set()

    async def serve() -> None:
        await asyncio.wait_for(RunStream(run, chunks())({"type": "http", "path": "/v1/completions"},
                                                        receive, send), timeout=10)

    asyncio.run(serve())
    return sent


def test_proxy_cancelled_receive_ends_the_stream_without_an_error():
    run = FakeRun()
    sent = _stream_closed_by(TaskCancelledError(), run)
    assert [m["type"] for m in sent][:2] == ["http.response.start", "http.response.body"]
    assert (run.cancelled, run.finished) == (1, 1)


def test_plain_disconnect_settles_the_run_once_too():
    run = FakeRun()
    _stream_closed_by(None, run)
    assert (run.cancelled, run.finished) == (1, 1)


def test_other_errors_from_receive_still_propagate():
    """Only the proxy's cancellation means "client gone"; a real failure still reaches the
    500 handler (and the run is still settled)."""
    run = FakeRun()
    with pytest.raises(RuntimeError, match="boom"):
        _stream_closed_by(RuntimeError("boom"), run)
    assert (run.cancelled, run.finished) == (1, 1)
