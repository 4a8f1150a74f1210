"""A gateway's calls to one of the cluster's named store actors (the Responses API's stored
responses, the Batch API's files and batches): the actor is looked up or created at the first
call, calls are no request's children (``detached``), and one that does not answer within
``CALL_TIMEOUT_S`` (or finds the actor dead) is the client's 503 naming the store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ray.exceptions import RayActorError

from kvharbor.actors.calls import detached
from kvharbor.platform.admission_flow import unavailable
from kvharbor.tenants.admission_actor import CALL_TIMEOUT_S


class StoreCalls:
    """``create``: gives the store's actor handle (``get_or_create_...``); ``what`` and ``code``
    name the store in the 503."""

    def __init__(self, create: Callable, what: str, code: str) -> None:
        self._create, self._what, self._code = create, what, code
        self._actor = None

    async def _call(self, method: str, *args):
        if self._actor is None:
            self._actor = detached(self._create())
        try:
            return await asyncio.wait_for(getattr(self._actor, method).remote(*args), CALL_TIMEOUT_S)
        except (TimeoutError, RayActorError):
            raise unavailable(self._what, self._code) from None


def page_after(items: list[dict], after: str | None, limit: int | None) -> tuple[list[dict], bool]:
    """OpenAI's cursor paging: the ``items`` that follow the one whose ``id`` is ``after`` (all of
    them when none is), at most ``limit`` (None: no limit); and whether more follow."""
    start = next((i + 1 for i, item in enumerate(items) if item.get("id") == after), 0) if after else 0
    end = len(items) if limit is None else start + limit
    return items[start:end], end < len(items)


def list_object(data: list[dict], more: bool) -> dict:
    """A page as OpenAI's list object (``first_id`` / ``last_id`` name the ends for the next call)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


__all__ = ["StoreCalls", "list_object", "page_after"]
