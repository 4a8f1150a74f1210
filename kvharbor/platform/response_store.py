"""Stored responses of the Responses API (``store: true``), for every gateway replica.

One named actor keeps, per response id, the tenant that made it, the response object
(``GET /v1/responses/{id}``) and its conversation (what ``previous_response_id`` continues).
A tenant reads and deletes only its own: another tenant's id is "not found", as an unknown one.
Memory is bounded (``max_bytes`` of JSON): the least recently used responses go first, and a
conversation continued from a stored response is kept in full by each of its turns, so a
turn's memory grows with its history (at most the context's worth of text).

The actor restarts when it dies (``max_restarts=-1``), empty: stored responses are then not
found (404) and a conversation must resend its history. A store that cannot be reached in
``CALL_TIMEOUT_S`` answers 503 (continuing) or logs (storing: the response is still given).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict

import ray

from kvharbor.platform.error_body import APIError
from kvharbor.platform.store_calls import StoreCalls

logger = logging.getLogger("kvharbor.responses")

DEFAULT_MAX_BYTES = 256 * 2**20
NAME = "kvharbor-response-store"


class ResponseStore:
    """Responses by id, LRU-bounded by their JSON size. Invariant: ``used`` = the sum of the
    kept entries' sizes <= ``max_bytes``."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self._entries: OrderedDict[str, tuple[str, dict, list[dict], int]] = OrderedDict()

    def put(self, tenant: str, response: dict, history: list[dict]) -> bool:
        """Keep ``response`` and the conversation it ends (False: too large to keep at all)."""
        size = len(json.dumps(response)) + len(json.dumps(history))
        self.delete(tenant, response["id"])
        if size > self.max_bytes:
            return False
        while self.used + size > self.max_bytes:
            _, (_, _, _, dropped) = self._entries.popitem(last=False)
            self.used -= dropped
        self._entries[response["id"]] = (tenant, response, history, size)
        self.used += size
        return True

    def get(self, tenant: str, response_id: str) -> tuple[dict, list[dict]] | None:
        """The response and its conversation, or None (unknown, evicted, or another tenant's)."""
        entry = self._entries.get(response_id)
        if entry is None or entry[0] != tenant:
            return None
        self._entries.move_to_end(response_id)
        return entry[1], entry[2]

    def delete(self, tenant: str, response_id: str) -> bool:
        entry = self._entries.get(response_id)
        if entry is None or entry[0] != tenant:
            return False
        del self._entries[response_id]
        self.used -= entry[3]
        return True

    def __len__(self) -> int:
        return len(self._entries)


@ray.remote(num_cpus=0, max_restarts=-1, allow_out_of_order_execution=True)
class ResponseStoreActor:
    """The cluster's one ``ResponseStore`` (methods run one at a time, so no lock)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._store = ResponseStore(max_bytes)

    def put(self, tenant: str, response: dict, history: list[dict]) -> bool:
        return self._store.put(tenant, response, history)

    def get(self, tenant: str, response_id: str):
        return self._store.get(tenant, response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._store.delete(tenant, response_id)


def get_or_create_response_store(name: str = NAME, namespace: str = "kvharbor"):
    """The named actor, created on first use (detached: it outlives gateway replicas)."""
    return ResponseStoreActor.options(name=name, namespace=namespace, lifetime="detached",
                                      get_if_exists=True).remote()


class StoredResponses(StoreCalls):
    """A gateway's calls to the store (the actor is created at the first call), with the
    errors a client gets: 404 for a response this tenant does not have, 503 for no answer."""

    def __init__(self) -> None:
        super().__init__(get_or_create_response_store, "response store", "response_store_unavailable")

    async def get(self, tenant: str, response_id: str, param: str) -> tuple[dict, list[dict]]:
        found = await self._call("get", tenant, response_id)
        if found is None:
            raise APIError(404, f"no stored response {response_id!r} of this tenant (never stored: store was "
                           "false, or deleted, or evicted)", "response_not_found", param)
        return found

    async def put(self, tenant: str, response: dict, history: list[dict]) -> None:
        """Keep a response; one the store cannot take is logged, not failed (the answer stands)."""
        try:
            if not await self._call("put", tenant, response, history):
                logger.warning("response %s is larger than the response store; not stored", response["id"])
        except APIError:
            logger.warning("response %s not stored: the response store did not answer", response["id"])

    async def delete(self, tenant: str, response_id: str) -> dict:
        if not await self._call("delete", tenant, response_id):
            raise APIError(404, f"no stored response {response_id!r} of this tenant", "response_not_found",
                           "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}
