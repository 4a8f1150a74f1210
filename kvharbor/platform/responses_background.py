"""Background responses of the Responses API (``background: true``): the request is answered at
once with the response ``queued``, and runs in the gateway replica that took it while the client
polls ``GET /v1/responses/{id}`` (``queued`` -> ``in_progress`` -> ``completed`` | ``incomplete``
| ``failed`` | ``cancelled``) or cancels it (``POST /v1/responses/{id}/cancel``, served by any
gateway replica: ``router``, which also lists a stored response's input items, ``GET
/v1/responses/{id}/input_items``).

The run is the same request served in the foreground (``Gateway._chat``: tenant limits, class,
queue, engine), its answer stored in the ``ResponseStore`` under the id the client was given,
with its conversation, so ``previous_response_id`` continues it. What would have been an error
answer (a 429 of the tenant's limits, a prompt too long) ends the response ``failed`` with that
error. The runner reports to the store every ``BEAT_S``: a cancel stops it at the next report
(its engine requests are aborted), and a runner that stops reporting (its replica died) leaves
the response ``failed`` (``runner_lost``) within ``STALE_S``.
"""

from __future__ import annotations

import asyncio
import logging

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from kvharbor.actors.calls import start_background
from kvharbor.platform.auth_gate import tenant_principal
from kvharbor.platform.error_body import APIError, error_responses
from kvharbor.platform.response_store import BEAT_S, StoredResponses
from kvharbor.platform.responses_api import responses_error
from kvharbor.platform.store_calls import list_object
from kvharbor.tenants import TenantError

logger = logging.getLogger("kvharbor.responses")

router = APIRouter()
stored = StoredResponses()
_running: set = set()        # the runner tasks of this replica (a task must be referenced)


async def start(gateway, principal, turn, request: Request, arrived: float) -> JSONResponse:
    """Store ``turn``'s response as queued, start its run here, answer the queued response."""
    queued = turn.response("queued")
    await stored.call("put", principal.tenant, queued, turn.conversation, turn.inputs)
    task = start_background(_run(gateway, principal, turn, request, arrived))
    _running.add(task)
    task.add_done_callback(_running.discard)
    return JSONResponse(queued)


async def _run(gateway, principal, turn, request: Request, arrived: float) -> None:
    tenant = principal.tenant

    async def finish(turn, response: dict) -> None:
        try:
            await stored.call("finish", tenant, response, turn.history(), turn.inputs)
        except APIError:
            logger.warning("background response %s: the store did not take its answer", response["id"])

    turn.on_done = finish
    work = asyncio.create_task(gateway._chat(principal, turn.chat, request, arrived, turn))
    status = "in_progress"
    try:
        while not work.done():
            try:
                status = await stored.call("beat", tenant, turn.id)
            except APIError:               # the store did not answer: try again at the next beat
                status = "in_progress"
            if status is None or status == "cancelled":
                work.cancel()
                break
            await asyncio.wait({work}, timeout=BEAT_S)
        await work
    except asyncio.CancelledError:
        if status is None or status == "cancelled":
            return                         # cancelled by the client, or the response is gone
        raise                              # the gateway replica is stopping
    except Exception as e:                 # noqa: BLE001 - what a foreground request was answered
        error = responses_error(e) if isinstance(e, (APIError, TenantError)) else None
        failed = turn.response("failed")
        failed["error"] = {"code": getattr(error, "code", None) or "server_error",
                           "message": error.message if error else "internal error; the response was not completed"}
        if error is None:
            logger.exception("background response %s failed", turn.id)
        await finish(turn, failed)


@router.post("/v1/responses/{response_id}/cancel", responses=error_responses(400, 401, 404, 503))
async def cancel_response(response_id: str, request: Request) -> dict:
    """Cancel a background response: ``cancelled`` now, its run stops within ``BEAT_S``; a
    finished one is answered as it is."""
    response = await stored.found("cancel", tenant_principal(request).tenant, response_id)
    if not response.get("background"):
        raise APIError(400, f"response {response_id!r} did not run in the background: only a background "
                       "response can be cancelled", "not_background", "response_id")
    return response


@router.get("/v1/responses/{response_id}/input_items", responses=error_responses(401, 404, 503))
async def input_items(response_id: str, request: Request, after: str | None = None,
                      limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc") -> dict:
    """A stored response's input items (OpenAI's list: newest first unless ``order=asc``)."""
    return list_object(*await stored.found("input_items", tenant_principal(request).tenant, response_id, after,
                                           limit, order))


__all__ = ["router", "start"]
