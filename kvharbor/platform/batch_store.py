"""Files and batches of the Batch API (``/v1/files``, ``/v1/batches``), for every gateway replica.

One named actor keeps, per tenant, the uploaded files (their bytes) and the batch objects. A
tenant sees only its own: another tenant's id is "not found", as an unknown one. File bytes
are bounded (``max_bytes`` in all): an upload that does not fit is refused (413), nothing is
evicted for room, so a running batch never loses its input or its results. A file goes when
it is deleted or when its ``expires_at`` passes (as OpenAI's: an uploaded ``batch`` file 30
days after upload unless its ``expires_after`` says otherwise; a batch's result files when
the batch's ``output_expires_after`` says; a batch keeps its input's bytes while it runs).

A batch runs in the gateway replica that created it (``batch_runner``); that replica reports
its progress here at least every ``HEARTBEAT_S``. A batch still running whose reports stopped
for ``STALE_S`` (its gateway replica died) is read as ``failed`` with the error
``runner_lost``: the client learns it should create the batch again instead of waiting.

The actor restarts when it dies (``max_restarts=-1``), empty: files and batches are then not
found (404). A store that cannot be reached in time answers 503 (``store_calls``).
"""

from __future__ import annotations

import time
import uuid

import ray

from kvharbor.platform.error_body import APIError
from kvharbor.platform.store_calls import StoreCalls, page_after

NAME = "kvharbor-batch-store"
DEFAULT_MAX_BYTES = 512 * 2**20
HEARTBEAT_S = 0.5
STALE_S = 60.0
RUNNING = ("validating", "in_progress", "finalizing", "cancelling")
"""A batch in one of these states still has a runner; the others are final."""
MAX_ACTIVE_BATCHES = 16
"""Batches one tenant may have running at once (more: 429)."""
BATCH_FILE_TTL_S = 30 * 24 * 3600
"""An uploaded ``batch`` file's life when its upload names no ``expires_after`` (OpenAI's)."""


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class BatchStore:
    """Files and batches by id. Invariant: ``used`` = the sum of the kept files' sizes <= ``max_bytes``."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, clock=time.time) -> None:
        self.max_bytes, self.used, self.clock = max_bytes, 0, clock
        self._files: dict[str, tuple[str, dict, bytes]] = {}
        self._batches: dict[str, tuple[str, dict]] = {}
        self._beats: dict[str, float] = {}
        self._output_ttl: dict[str, int | None] = {}      # batch -> its result files' life (s)

    # ---- files ---------------------------------------------------------------------------
    def add_file(self, tenant: str, filename: str, purpose: str, content: bytes,
                 expires_after_s: int | None = None) -> dict | None:
        """Keep ``content`` (for ``expires_after_s`` seconds, else for good); its file object, or
        None when the store has no room for it."""
        self._expire()
        if self.used + len(content) > self.max_bytes:
            return None
        now = int(self.clock())
        meta = {"id": new_id("file-"), "object": "file", "bytes": len(content), "created_at": now,
                "filename": filename, "purpose": purpose, "status": "processed",
                "expires_at": None if expires_after_s is None else now + expires_after_s, "status_details": None}
        self._files[meta["id"]] = (tenant, meta, content)
        self.used += len(content)
        return meta

    def file(self, tenant: str, file_id: str) -> dict | None:
        self._expire()
        entry = self._files.get(file_id)
        return entry[1] if entry and entry[0] == tenant else None

    def content(self, tenant: str, file_id: str) -> bytes | None:
        self._expire()
        entry = self._files.get(file_id)
        return entry[2] if entry and entry[0] == tenant else None

    def delete_file(self, tenant: str, file_id: str) -> bool:
        self._expire()
        entry = self._files.get(file_id)
        if entry is None or entry[0] != tenant:
            return False
        del self._files[file_id]
        self.used -= len(entry[2])
        return True

    def files(self, tenant: str, purpose: str | None = None, after: str | None = None,
              limit: int | None = None, order: str = "desc") -> tuple[list[dict], bool]:
        """The tenant's files (of ``purpose``) newest first (``order`` "asc": oldest first), those
        after the file ``after`` in that order, at most ``limit``; and whether more follow."""
        self._expire()
        found = [m for t, m, _ in self._files.values() if t == tenant and purpose in (None, m["purpose"])]
        return page_after(found[::-1] if order == "desc" else found, after, limit)

    def room(self) -> tuple[int, int]:
        self._expire()
        return self.used, self.max_bytes

    def _expire(self) -> None:
        """Forget the files whose ``expires_at`` has passed."""
        now = self.clock()
        for file_id in [i for i, (_, m, _) in self._files.items() if m["expires_at"] is not None and m["expires_at"] <= now]:
            self.used -= len(self._files.pop(file_id)[2])

    # ---- batches -------------------------------------------------------------------------
    def add_batch(self, tenant: str, batch: dict, output_expires_after_s: int | None = None) -> dict | None:
        """Keep a new batch (status ``validating``), its result files to be kept for
        ``output_expires_after_s`` seconds (None: for good); None when the tenant has too many running."""
        if sum(1 for t, b in self._batches.values() if t == tenant and b["status"] in RUNNING) >= MAX_ACTIVE_BATCHES:
            return None
        self._batches[batch["id"]] = (tenant, batch)
        self._output_ttl[batch["id"]] = output_expires_after_s
        self._beats[batch["id"]] = self.clock()
        return batch

    def batch(self, tenant: str, batch_id: str) -> dict | None:
        entry = self._batches.get(batch_id)
        if entry is None or entry[0] != tenant:
            return None
        return self._checked(batch_id, entry[1])

    def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """The tenant's batches, newest first, those after ``after`` (an id); and whether more follow."""
        page, more = page_after([b for t, b in self._batches.values() if t == tenant][::-1], after, limit)
        return [self._checked(b["id"], b) for b in page], more

    def cancel(self, tenant: str, batch_id: str) -> dict | None:
        """Ask a running batch to stop (its runner finishes the lines under way); a final one is
        returned as it is."""
        batch = self.batch(tenant, batch_id)
        if batch is not None and batch["status"] in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=int(self.clock()))
        return batch

    def update(self, batch_id: str, changes: dict) -> str | None:
        """A runner's report: merge ``changes`` into the batch and note the heartbeat. Returns the
        batch's status (``cancelling`` tells the runner to stop), or None for a batch no longer
        kept (the store restarted) or already declared lost."""
        entry = self._batches.get(batch_id)
        if entry is None or entry[1]["status"] not in RUNNING:
            return None
        batch = entry[1]
        if batch["status"] == "cancelling":       # only the runner's end changes it now
            changes = {k: v for k, v in changes.items() if k != "status" or v in ("cancelled", "failed")}
        batch.update(changes)
        self._beats[batch_id] = self.clock()
        return batch["status"]

    def finish(self, tenant: str, batch_id: str, changes: dict, files: dict[str, tuple[str, bytes]]) -> str | None:
        """A runner's last report: its result files (field -> (filename, bytes)) are kept as the
        tenant's ``batch_output`` files and their ids set on the batch; files that do not fit
        fail the batch instead."""
        entry = self._batches.get(batch_id)
        if entry is None or entry[1]["status"] not in RUNNING:
            return None
        if self.used + sum(len(c) for _, c in files.values()) > self.max_bytes:
            return self.update(batch_id, {"status": "failed", "failed_at": int(self.clock()), "errors": errors_list(
                [{"code": "output_too_large", "message": "the batch's results do not fit in the file store "
                  f"({self.used} of {self.max_bytes} bytes used): delete files and create the batch again"}])})
        if entry[1]["status"] == "cancelling":       # cancelled after its last line started
            ended = changes.pop("status")
            changes.pop(f"{ended}_at", None)
            changes.update(status="cancelled", cancelled_at=int(self.clock()))
        for field, (filename, content) in files.items():
            meta = self.add_file(tenant, filename, "batch_output", content, self._output_ttl.get(batch_id))
            changes[field] = meta["id"]
        return self.update(batch_id, changes)

    def _checked(self, batch_id: str, batch: dict) -> dict:
        """The batch, declared failed first if its runner stopped reporting."""
        if batch["status"] in RUNNING and self.clock() - self._beats.get(batch_id, 0.0) > STALE_S:
            batch.update(status="failed", failed_at=int(self.clock()), errors=errors_list(
                [{"code": "runner_lost", "message": f"the gateway replica running this batch stopped reporting "
                  f"for {STALE_S:g} s (it stopped or restarted): create the batch again"}]))
        return batch


def errors_list(errors: list[dict]) -> dict:
    """A batch's ``errors`` field: OpenAI's list of {code, message, param, line}."""
    return {"object": "list", "data": [{"param": None, "line": None, **e} for e in errors]}


@ray.remote(num_cpus=0, max_restarts=-1, allow_out_of_order_execution=True)
class BatchStoreActor:
    """The cluster's one ``BatchStore`` (methods run one at a time, so no lock)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._store = BatchStore(max_bytes)

    def call(self, method: str, *args):
        return getattr(self._store, method)(*args)


def get_or_create_batch_store(name: str = NAME, namespace: str = "kvharbor"):
    """The named actor, created on first use (detached: it outlives gateway replicas)."""
    return BatchStoreActor.options(name=name, namespace=namespace, lifetime="detached",
                                   get_if_exists=True).remote()


class StoredBatches(StoreCalls):
    """A gateway's calls to the store (the actor is created at the first call), with the
    errors a client gets: 404 for a file or batch this tenant does not have, 503 for no answer."""

    def __init__(self) -> None:
        super().__init__(get_or_create_batch_store, "batch store", "batch_store_unavailable")

    async def call(self, method: str, *args):
        """``BatchStore.<method>(*args)`` in the actor."""
        return await self._call("call", method, *args)

    async def found(self, method: str, tenant: str, some_id: str, what: str, param: str):
        """``method(tenant, id)``'s answer, or a 404 naming ``what`` was not found."""
        answer = await self.call(method, tenant, some_id)
        if answer is None or answer is False:
            raise APIError(404, f"no {what} {some_id!r} of this tenant (never created, deleted, or the "
                           "store restarted)", f"{what.replace(' ', '_')}_not_found", param)
        return answer


__all__ = ["BatchStore", "BatchStoreActor", "StoredBatches", "get_or_create_batch_store", "errors_list"]
