"""Direct streams: a pinned-class request's events over one TCP connection to its replica.

A Serve handle call and its token stream cross Ray's actor-call machinery both ways. On this
project's 2-core VM a one-event stream between two Serve replicas took 9.2 ms p50 (23 ms p99)
through a handle, 5.5 ms with Serve's gRPC transport and 0.5 ms (1.9 ms p99) over a plain
asyncio TCP connection between the same two processes; an idle premium request's "hops"
(router, Ray, the replica's intake and the first token's way back) were 9-11 ms of its
time to first token. So requests of pinned QoS classes go straight to their replica:

    gateway: GenerationRun._call ─▶ DirectStream ──▶ KVAwareRouter.route_direct
                 │ connect host:port of the chosen replica, send token + request
                 ▼
    replica: DirectStreamServer ──▶ LLMReplica.generate(request) ──▶ one frame per event

The routing decision is the KV-aware router's own (``route_direct`` ranks the replicas as
``choose_replicas`` does and books the send the same way), made on the gateway's own loop
when the router's state lock is free and the router follows the index (otherwise on the
loop Serve routes on, which waits for the index's first poll).
Other classes keep Serve's handle path, and with it Serve's ``max_ongoing_requests``
backpressure; so does a pinned request when no replica has reported an address yet, or when
no router of the deployment lives in this process yet.

Wire format: the client sends the replica's token (``TOKEN_BYTES`` random bytes, published
with its address in the replica's routing stats, which only Serve's controller and routers
read), then one frame, the pickled ``GenerateRequest``; the replica answers one frame per
event and an empty frame at the end. A frame is a 4-byte big-endian length and a pickle. The
replica checks the token before it unpickles anything. The client closing its connection
(cancel, a client that went away) aborts the request on the replica, as a cancelled handle
call does; a replica that closes the connection before the end frame raises
``DirectStreamFailed`` (a ``ConnectionError``: the gateway retries it elsewhere when no token
was out yet).

What Serve does not see: a replica's ongoing-request count (which Serve's draining and
autoscaling read) leaves direct streams out. So the replica drains them itself: when Serve
stops it (scale-down, redeploy, delete), after Serve's own requests have finished,
``LLMReplica.__del__`` stops listening (a gateway that still picks it is refused and retries
elsewhere) and lets the open direct streams finish (``DirectStreamServer.drain``) within the
deployment's ``graceful_shutdown_timeout_s``; and it reports its open direct streams to
Serve's autoscaler, whose policy kvharbor sets to count them (``kvharbor.platform.
autoscaling``). The replicas' own routing stats and metrics count every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pickle
import secrets
import struct
from collections.abc import AsyncIterator, Callable

from kvharbor.platform.protocol import GenerateRequest

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32
HEADER = struct.Struct("!I")
MAX_REQUEST_BYTES = 64 * 1024 * 1024      # a request frame larger than this is refused
CONNECT_TIMEOUT_S = 2.0
HANDSHAKE_TIMEOUT_S = 5.0


class DirectStreamFailed(ConnectionError):
    """The direct connection to a replica failed or ended before the stream's end."""


def _frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader, limit: int | None = None) -> bytes:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if limit is not None and size > limit:
        raise ValueError(f"frame of {size} bytes over the limit of {limit}")
    return await reader.readexactly(size) if size else b""


class DirectStreamServer:
    """The replica's end: serves ``generate(request)``'s events to direct connections.

    Args:
        generate: the replica's ``generate`` (an async iterator of event dicts per request).
        host: the address to listen on (the node's: loopback on a loopback node).
    """

    def __init__(self, generate: Callable[[GenerateRequest], AsyncIterator[dict]],
                 host: str) -> None:
        self._generate = generate
        self.host = host
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._server: asyncio.base_events.Server | None = None
        self._starting: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()    # one task per accepted connection

    @property
    def address(self) -> list | None:
        """``[host, port, token hex]`` once listening (what routing stats carry), else None."""
        if self._server is None:
            return None
        return [self.host, self._server.sockets[0].getsockname()[1], self.token.hex()]

    async def start(self) -> None:
        """Listen (once; concurrent callers wait for the same start)."""
        if self._server is not None:
            return
        if self._starting is None:
            self._starting = asyncio.ensure_future(
                asyncio.start_server(self._serve, self.host, 0))
        self._server = await asyncio.shield(self._starting)

    @property
    def open_streams(self) -> int:
        """Connections accepted and not yet ended."""
        return len(self._connections)

    def close(self) -> None:
        """Stop listening; the open streams go on."""
        if self._server is not None:
            self._server.close()

    async def drain(self, timeout_s: float) -> int:
        """Stop listening, then wait up to ``timeout_s`` for the open streams to end. Returns
        how many are still open (cut when the process exits)."""
        self.close()
        if self._connections:
            await asyncio.wait(set(self._connections), timeout=timeout_s)
        return len(self._connections)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HANDSHAKE_TIMEOUT_S)
            if not hmac.compare_digest(token, self.token):
                logger.warning("direct stream refused: wrong token from %s",
                               writer.get_extra_info("peername"))
                return
            body = await asyncio.wait_for(_read_frame(reader, MAX_REQUEST_BYTES),
                                          HANDSHAKE_TIMEOUT_S)
            request = pickle.loads(body)
            if not isinstance(request, GenerateRequest):
                logger.warning("direct stream refused: not a GenerateRequest")
                return
            await self._stream(request, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ValueError) as e:
            logger.info("direct stream closed early: %r", e)
        finally:
            writer.close()
            self._connections.discard(task)

    async def _stream(self, request: GenerateRequest, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        """Forward the events until the end, or until the client goes away (which aborts the
        request: the cancelled ``generate`` ends the way a cancelled handle call does)."""
        events = self._generate(request)
        pump = asyncio.ensure_future(self._pump(events, writer))
        gone = asyncio.ensure_future(reader.read(1))        # b"" (or anything): client is done
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await pump
            gone.cancel()
            await events.aclose()
        if pump.done() and not pump.cancelled():
            pump.result()                                   # raise what the pump raised

    @staticmethod
    async def _pump(events: AsyncIterator[dict], writer: asyncio.StreamWriter) -> None:
        async for event in events:
            writer.write(_frame(pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)))
            await writer.drain()
        writer.write(_frame(b""))
        await writer.drain()


class DirectStream:
    """The gateway's end: one request's events from its replica, iterated like a Serve
    streaming response (``async for``), ``cancel()`` to abort it.

    Args:
        route: coroutine function giving ``(replica unique id, [host, port, token hex])`` for
            the request, or None to take the ``fallback`` instead (it books the send).
        done: called with the replica's id when a stream that ``route`` chose ends.
        request: what is sent.
        fallback: returns Serve's streaming response for the request (no direct address).
    """

    def __init__(self, route, done: Callable[[str], None], request: GenerateRequest,
                 fallback: Callable[[], object]) -> None:
        self._route, self._done, self.request, self._fallback = route, done, request, fallback
        self._writer: asyncio.StreamWriter | None = None
        self._serve_stream = None
        self._cancelled = False
        self.replica: str | None = None       # set once routed directly
        self._open = False                    # a routed stream whose end is not reported yet

    def __aiter__(self) -> AsyncIterator[dict]:
        return self._events()

    def cancel(self) -> None:
        """Abort: close the connection (the replica aborts the request) or cancel Serve's."""
        self._cancelled = True
        if self._writer is not None:
            self._writer.close()
        if self._serve_stream is not None:
            self._serve_stream.cancel()
        self._ended()

    def _ended(self) -> None:
        if self._open:
            self._open = False
            self._done(self.replica)

    async def _events(self) -> AsyncIterator[dict]:
        choice = await self._route(self.request)
        if self._cancelled and choice is None:
            return
        if choice is None:
            self._serve_stream = self._fallback()
            async for event in self._serve_stream:
                yield event
            return
        self.replica, (host, port, token) = choice
        self._open = True
        try:
            if not self._cancelled:
                async for event in self._direct(host, int(port), bytes.fromhex(token)):
                    yield event
        finally:
            self._ended()

    async def _direct(self, host: str, port: int, token: bytes) -> AsyncIterator[dict]:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                    CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as e:
            raise DirectStreamFailed(f"could not reach replica {self.replica} at "
                                     f"{host}:{port}: {e!r}") from e
        self._writer = writer
        try:
            writer.write(token + _frame(pickle.dumps(self.request,
                                                     protocol=pickle.HIGHEST_PROTOCOL)))
            await writer.drain()
            while True:
                body = await _read_frame(reader)
                if not body:
                    return
                yield pickle.loads(body)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if self._cancelled:
                return
            raise DirectStreamFailed(f"replica {self.replica} closed the stream before its "
                                     f"end: {e!r}") from e
        finally:
            writer.close()


def start_request_router(handle) -> None:
    """Make ``handle``'s request router now rather than on its first call: direct streams ask
    it for their replica (``KVAwareRouter.for_handle``) and take Serve's path until it exists."""
    init = getattr(handle, "_init_router", None)     # Serve's lazy init; absent: not a handle
    if init is None or getattr(handle, "is_initialized", True):
        return
    try:
        init()
    except Exception as exc:  # noqa: BLE001 - the first call makes it instead
        logger.info("could not start the request router of %s early: %r", handle, exc)
