"""Stored responses of the Responses API (``store: true``), for every gateway replica.

One named actor keeps, per response id, the tenant that made it, the response object
(``GET /v1/responses/{id}``), its conversation (what ``previous_response_id`` continues) and
its request's input items (``GET /v1/responses/{id}/input_items``).
A tenant reads and deletes only its own: another tenant's id is "not found", as an unknown one.
Memory is bounded (``max_bytes`` of JSON): the least recently used responses go first, and a
conversation continued from a stored response is kept in full by each of its turns, so a
turn's memory grows with its history (at most the context's worth of text).

A background response (``background: true``, ``responses_background``) is kept while it runs,
``queued`` or ``in_progress``: its runner reports every ``BEAT_S`` (``beat``, which tells it
whether the client cancelled), ``cancel`` marks it ``cancelled`` (the runner stops at its next
report, and its answer does not overwrite the cancel: ``finish``), and one whose runner has not
reported for ``STALE_S`` (its gateway replica died) reads as ``failed`` (``runner_lost``).

The actor restarts when it dies (``max_restarts=-1``), empty: stored responses are then not
found (404) and a conversation must resend its history. A store that cannot be reached in
``CALL_TIMEOUT_S`` answers 503 (continuing) or logs (storing: the response is still given).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict

import ray

from kvharbor.platform.error_body import APIError
from kvharbor.platform.store_calls import StoreCalls, page_after

logger = logging.getLogger("kvharbor.responses")

DEFAULT_MAX_BYTES = 256 * 2**20
NAME = "kvharbor-response-store"
RUNNING = ("queued", "in_progress")
BEAT_S = 1.0
STALE_S = 30.0


class ResponseStore:
    """Responses by id, LRU-bounded by their JSON size. Invariant: ``used`` = the sum of the
    kept entries' sizes <= ``max_bytes``."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, clock=time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        # id -> (tenant, response, conversation, size in bytes, input items)
        self._entries: OrderedDict[str, tuple[str, dict, list[dict], int, list[dict]]] = OrderedDict()
        self._beats: dict[str, float] = {}       # running background responses: last report
        self._clock = clock

    def put(self, tenant: str, response: dict, history: list[dict], inputs: list[dict] | None = None) -> bool:
        """Keep ``response``, the conversation it ends and its request's input items (False: too
        large to keep at all)."""
        inputs = inputs or []
        size = len(json.dumps(response)) + len(json.dumps(history)) + len(json.dumps(inputs))
        self.delete(tenant, response["id"])
        if size > self.max_bytes:
            return False
        while self.used + size > self.max_bytes:
            evicted, (_, _, _, dropped, _) = self._entries.popitem(last=False)
            self._beats.pop(evicted, None)
            self.used -= dropped
        self._entries[response["id"]] = (tenant, response, history, size, inputs)
        self.used += size
        if response.get("status") in RUNNING:
            self._beats[response["id"]] = self._clock()
        return True

    def get(self, tenant: str, response_id: str) -> tuple[dict, list[dict]] | None:
        """The response and its conversation, or None (unknown, evicted, or another tenant's)."""
        entry = self._entries.get(response_id)
        if entry is None or entry[0] != tenant:
            return None
        self._entries.move_to_end(response_id)
        response = entry[1]
        if response.get("status") in RUNNING and self._clock() - self._beats.get(response_id, 0.0) > STALE_S:
            response.update(status="failed", error={
                "code": "runner_lost", "message": f"the gateway replica running this response stopped reporting "
                f"for {STALE_S:g} s (it stopped or restarted): create the response again"})
            self._beats.pop(response_id, None)
        return response, entry[2]

    def beat(self, tenant: str, response_id: str) -> str | None:
        """A background runner's report: its response is ``in_progress`` unless cancelled.
        Returns the response's status (``cancelled``: stop), or None for one no longer kept
        (the store restarted, evicted, deleted, declared lost)."""
        found = self.get(tenant, response_id)
        if found is None or found[0]["status"] not in RUNNING + ("cancelled",):
            return None
        response = found[0]
        if response["status"] in RUNNING:
            response["status"] = "in_progress"
            self._beats[response_id] = self._clock()
        return response["status"]

    def cancel(self, tenant: str, response_id: str) -> dict | None:
        """Mark a running background response ``cancelled`` (a finished one is left as it is);
        the response, or None (not this tenant's)."""
        found = self.get(tenant, response_id)
        if found is None:
            return None
        if found[0]["status"] in RUNNING:
            found[0]["status"] = "cancelled"
            self._beats.pop(response_id, None)
        return found[0]

    def finish(self, tenant: str, response: dict, history: list[dict], inputs: list[dict] | None = None) -> bool:
        """A background runner's final response, kept unless the response was cancelled or is
        gone meanwhile (False then)."""
        found = self.get(tenant, response["id"])
        if found is None or found[0]["status"] not in RUNNING:
            return False
        self._beats.pop(response["id"], None)
        return self.put(tenant, response, history, inputs)

    def input_items(self, tenant: str, response_id: str, after: str | None, limit: int,
                    order: str) -> tuple[list[dict], bool] | None:
        """A page of the response's input items (``order`` ``asc``: as sent, ``desc``: last
        first), those after item ``after``; and whether more follow. None: not this tenant's."""
        if self.get(tenant, response_id) is None:
            return None
        items = self._entries[response_id][4]
        return page_after(items if order == "asc" else items[::-1], after, limit)

    def delete(self, tenant: str, response_id: str) -> bool:
        entry = self._entries.get(response_id)
        if entry is None or entry[0] != tenant:
            return False
        del self._entries[response_id]
        self._beats.pop(response_id, None)
        self.used -= entry[3]
        return True

    def __len__(self) -> int:
        return len(self._entries)


@ray.remote(num_cpus=0, max_restarts=-1, allow_out_of_order_execution=True)
class ResponseStoreActor:
    """The cluster's one ``ResponseStore`` (methods run one at a time, so no lock)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._store = ResponseStore(max_bytes)

    def put(self, tenant: str, response: dict, history: list[dict], inputs: list[dict] | None = None) -> bool:
        return self._store.put(tenant, response, history, inputs)

    def get(self, tenant: str, response_id: str):
        return self._store.get(tenant, response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._store.delete(tenant, response_id)

    def beat(self, tenant: str, response_id: str) -> str | None:
        return self._store.beat(tenant, response_id)

    def cancel(self, tenant: str, response_id: str) -> dict | None:
        return self._store.cancel(tenant, response_id)

    def finish(self, tenant: str, response: dict, history: list[dict], inputs: list[dict] | None = None) -> bool:
        return self._store.finish(tenant, response, history, inputs)

    def input_items(self, tenant: str, response_id: str, after: str | None, limit: int, order: str):
        return self._store.input_items(tenant, response_id, after, limit, order)


def get_or_create_response_store(name: str = NAME, namespace: str = "kvharbor"):
    """The named actor, created on first use (detached: it outlives gateway replicas)."""
    return ResponseStoreActor.options(name=name, namespace=namespace, lifetime="detached",
                                      get_if_exists=True).remote()


class StoredResponses(StoreCalls):
    """A gateway's calls to the store (the actor is created at the first call), with the
    errors a client gets: 404 for a response this tenant does not have, 503 for no answer."""

    def __init__(self) -> None:
        super().__init__(get_or_create_response_store, "response store", "response_store_unavailable")

    async def call(self, method: str, *args):
        """``ResponseStoreActor.<method>(*args)`` (503 when the store does not answer)."""
        return await self._call(method, *args)

    async def found(self, method: str, tenant: str, response_id: str, *args):
        """``method(tenant, response_id, *args)``'s answer, or the 404 of a response this tenant
        does not have (None or False)."""
        answer = await self._call(method, tenant, response_id, *args)
        if answer is None or answer is False:
            raise APIError(404, f"no stored response {response_id!r} of this tenant", "response_not_found",
                           "response_id")
        return answer

    async def get(self, tenant: str, response_id: str, param: str) -> tuple[dict, list[dict]]:
        found = await self._call("get", tenant, response_id)
        if found is None:
            raise APIError(404, f"no stored response {response_id!r} of this tenant (never stored: store was "
                           "false, or deleted, or evicted)", "response_not_found", param)
        return found

    async def put(self, tenant: str, response: dict, history: list[dict], inputs: list[dict] | None = None) -> None:
        """Keep a response; one the store cannot take is logged, not failed (the answer stands)."""
        try:
            if not await self._call("put", tenant, response, history, inputs):
                logger.warning("response %s is larger than the response store; not stored", response["id"])
        except APIError:
            logger.warning("response %s not stored: the response store did not answer", response["id"])

    async def delete(self, tenant: str, response_id: str) -> dict:
        await self.found("delete", tenant, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
