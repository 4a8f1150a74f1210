"""Actor calls that change shared state, awaited so that a cancelled caller cannot leak it.

A gateway handler that is cancelled (the client disconnected) while it awaits
``admission.try_admit`` or ``class_queue.enter`` cancels only its own wait: the actor still
runs the call and takes a concurrency slot or a queue place that nobody will give back.
``await_or_undo`` keeps the call running past the cancellation and, when it completes,
hands its result to ``undo`` so the slot is returned. With ``timeout_s`` a call that does not
answer in time (the actor is down or restarting) raises ``TimeoutError`` and is undone the same
way should it complete later.
"""

from __future__ import annotations

import asyncio
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
