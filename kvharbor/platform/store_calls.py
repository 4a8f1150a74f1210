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


__all__ = ["StoreCalls"]
