"""``RunStream``: the SSE response of a ``GenerationRun`` (chat, completions and Responses streams)."""

import logging

from fastapi.responses import StreamingResponse
from ray.exceptions import TaskCancelledError

from kvharbor.platform.error_body import APIError
from kvharbor.platform.generation import GenerationRun

logger = logging.getLogger("kvharbor.gateway")


class RunStream(StreamingResponse):
    """SSE response that always settles its ``GenerationRun``.

    If the client goes away, even before the first chunk was produced, the replica call is
    cancelled (the engine aborts the request and frees its blocks) and the run's accounting
    (metrics, admission ticket, class queue) is released exactly once.

    Behind Serve's proxy a client's close can reach the stream as ``TaskCancelledError`` from
    ``receive`` (the proxy cancels the gateway's pending call for the client's next message)
    instead of an ``http.disconnect`` message. That is the same disconnect, not a server
    error: the stream ends quietly rather than through the 500 handler's stack trace.

    The status line waits for the first chunk: a run that fails before it (``stream_chunks``
    raises the ``APIError``) is answered with that error's status and JSON body instead.
    """

    def __init__(self, run: GenerationRun, chunks) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self.run = run

    async def stream_response(self, send) -> None:
        chunks = aiter(self.body_iterator)
        try:
            first = await anext(chunks)
        except APIError as e:
            error = e.response()
            await send({"type": "http.response.start", "status": error.status_code, "headers": error.raw_headers})
            await send({"type": "http.response.body", "body": error.body})
            return
        self.body_iterator = _prepend(first, chunks)
        await super().stream_response(send)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except TaskCancelledError:
            logger.debug("client went away during %s (the proxy cancelled the call)",
                         scope.get("path"))
        finally:
            self.run.cancel()
            await self.run.finish()


async def _prepend(first, rest):
    yield first
    async for item in rest:
        yield item
