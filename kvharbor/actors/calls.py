"""Actor calls that change shared state, awaited so that a cancelled caller cannot leak it.

A gateway handler that is cancelled (the client disconnected) while it awaits
``admission.try_admit`` or ``class_queue.enter`` cancels only its own wait: the actor still
runs the call and takes a concurrency slot or a queue place that nobody will give back.
``await_or_undo`` keeps the call running past the cancellation and, when it completes,
hands its result to ``undo`` so the slot is returned. With ``timeout_s`` a call that does not
answer in time (the actor is down or restarting) raises ``TimeoutError`` and is undone the same
way should it complete later.

Calls and tasks that must outlive the request that happens to make them
(``detached``, ``start_background``): Ray Serve cancels a request whose client went away by
cancelling its Ray task *recursively*, which also cancels every actor call submitted from the
request's coroutines (and from tasks they started: a task copies its creator's context) that
has not finished. A fire-and-forget ``leave`` or ``release`` is then lost, and one cancelled
before it was sent leaves a hole in the caller's sequence numbers: a synchronous actor holds
back every later call from that caller for 30 s waiting for it, then cancels them all (the
gateway answered 503 "did not answer within 5 s" for minutes). Ray tells which request a call
belongs to from a context variable, so a call or task started in a fresh context belongs to
none (Serve's own long-poll client does the same).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def await_or_undo(call: Awaitable[T], undo: Callable[[T], Any],
                        timeout_s: float | None = None) -> T:
    """Await ``call`` (an ObjectRef or coroutine); if the caller is cancelled first (or
    ``timeout_s`` passes), call ``undo(result)`` once the call completes, then let the
    cancellation (``TimeoutError``) propagate."""
    fut = asyncio.ensure_future(call)
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
    except (asyncio.CancelledError, TimeoutError):
        def _undo(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                undo(done.result())
        fut.add_done_callback(_undo)
        raise


class detached:
    """An actor handle whose calls are no request's children (see the module docstring):
    ``detached(handle).method.remote(*args)`` submits ``handle.method.remote(*args)`` in a
    fresh context. Awaiting the result is unchanged; cancelling the awaiting coroutine stops
    the wait only (``await_or_undo`` gives back what the call took)."""

    __slots__ = ("handle",)

    def __init__(self, handle) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> _DetachedMethod:
        if name.startswith("__") or name == "handle":    # pickle probing a half-built one
            raise AttributeError(name)
        return _DetachedMethod(getattr(self.handle, name))

    def __reduce__(self):
        return detached, (self.handle,)


class _DetachedMethod:
    __slots__ = ("method",)

    def __init__(self, method) -> None:
        self.method = method

    def remote(self, *args, **kwargs):
        return contextvars.Context().run(self.method.remote, *args, **kwargs)


def start_background(coro, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task:
    """Start a long-lived task (engine loop, lease renewal, index follower) in a fresh
    context, so that cancelling the request that happened to start it cancels none of the
    actor calls it makes later."""
    loop = loop or asyncio.get_running_loop()
    return loop.create_task(coro, context=contextvars.Context())


def on_event_loop() -> bool:
    """Whether this thread runs an asyncio loop now (so ``start_background`` can start a task
    here): true in a Serve constructor, false where an object is built outside any loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
