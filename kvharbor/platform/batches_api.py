"""OpenAI's Files and Batch APIs: a tenant uploads a JSONL file of requests, creates a batch,
and collects the answers later as a file (``client.files.create(purpose="batch")``,
``client.batches.create(...)``, ``client.batches.retrieve(...)``, ``client.files.content(...)``).

    POST   /v1/files                  upload (multipart: ``file``, ``purpose="batch"``, ``expires_after``)
    GET    /v1/files[?purpose=&after=&limit=&order=]   the tenant's files, newest first
    GET    /v1/files/{id}             one file's object
    GET    /v1/files/{id}/content     its bytes (an input file, or a batch's output / errors)
    DELETE /v1/files/{id}
    POST   /v1/batches                {input_file_id, endpoint, completion_window: "24h", metadata,
                                       output_expires_after}
    GET    /v1/batches[?after=&limit=]
    GET    /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

Endpoints a batch may target: ``BATCH_ENDPOINTS`` (generation, embeddings, scoring). Files and
batches are kept by the store actor (``batch_store``); a batch runs in the gateway replica
that created it (``batch_runner``), its lines at the tenant's class and limits beside its
interactive traffic. An upload is bounded by the app's ``max_body_bytes`` (413 above it).

The routes read the principal ``AuthGateMiddleware`` left for the request (``/v1/`` is a
protected prefix), so the Gateway only includes ``router``.
"""

from __future__ import annotations

import time
from typing import Literal

import httpx
from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, Field

from kvharbor.actors.calls import start_background
from kvharbor.observability.metrics import get_metrics
from kvharbor.platform.auth_gate import bearer_key, tenant_principal
from kvharbor.platform.batch_runner import BatchRunner
from kvharbor.platform.batch_store import BATCH_FILE_TTL_S, StoredBatches, new_id
from kvharbor.platform.error_body import APIError, error_dict, error_responses
from kvharbor.platform.json_types import REQUEST_FIELDS
from kvharbor.platform.store_calls import list_object

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
                   "/v1/score", "/v1/rerank")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
TTL_S = (3600, 30 * 24 * 3600)
"""Shortest and longest life a file's ``expires_after`` may ask (OpenAI's)."""

router = APIRouter()
stored = StoredBatches()
_running: set = set()        # the runner tasks of this replica (a task must be referenced)


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy of a file: ``seconds`` after its creation."""

    model_config = REQUEST_FIELDS
    anchor: Literal["created_at"] = Field(description="Only \"created_at\": the file's creation.")
    seconds: int = Field(ge=TTL_S[0], le=TTL_S[1], description="3,600 (1 hour) to 2,592,000 (30 days).")


class BatchCreateRequest(BaseModel):
    model_config = REQUEST_FIELDS
    input_file_id: str = Field(description="A file uploaded with purpose \"batch\": one request per line.")
    endpoint: Literal[BATCH_ENDPOINTS] = Field(description="The route every line of the file is sent to.")
    completion_window: Literal["24h"] = Field("24h", description="Lines not started within it end expired.")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Up to 16 key-value pairs kept "
                                            "on the batch.")
    output_expires_after: ExpiresAfter | None = Field(None, description="The batch's output and error files "
                                                      "are deleted this long after they are written (default: "
                                                      "kept until deleted).")


@router.post("/v1/files", responses=error_responses(400, 401, 413, 503))
async def upload_file(request: Request, file: UploadFile = File(description="The JSONL file."),
                      purpose: Literal["batch"] = Form(description="Only \"batch\" is served."),
                      anchor: str | None = Form(None, alias="expires_after[anchor]", description=(
                          "With expires_after[seconds]: only \"created_at\".")),
                      seconds: str | None = Form(None, alias="expires_after[seconds]", description=(
                          "The file is deleted this long after its upload: 3,600 to 2,592,000 seconds "
                          "(default: 30 days, as OpenAI's)."))) -> dict:
    principal = tenant_principal(request)
    ttl = _expires_after(anchor, seconds)
    content = await file.read()
    meta = await stored.call("add_file", principal.tenant, file.filename or "upload.jsonl", purpose, content, ttl)
    if meta is None:
        used, most = await stored.call("room")
        raise APIError(413, f"the file store is full ({used} of {most} bytes used): delete files you no "
                       "longer need (DELETE /v1/files/{id}) and upload again", "file_store_full", "file")
    return meta


@router.get("/v1/files", responses=error_responses(401, 503))
async def list_files(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = Query(10_000, ge=1, le=10_000), order: Literal["asc", "desc"] = "desc") -> dict:
    page, more = await stored.call("files", tenant_principal(request).tenant, purpose, after, limit, order)
    return list_object(page, more)


@router.get("/v1/files/{file_id}", responses=error_responses(401, 404, 503))
async def get_file(file_id: str, request: Request) -> dict:
    return await stored.found("file", tenant_principal(request).tenant, file_id, "file", "file_id")


@router.get("/v1/files/{file_id}/content", responses={200: {"content": {"application/jsonl": {}}},
                                                       **error_responses(401, 404, 503)})
async def file_content(file_id: str, request: Request) -> Response:
    content = await stored.found("content", tenant_principal(request).tenant, file_id, "file", "file_id")
    return Response(content, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}", responses=error_responses(401, 404, 503))
async def delete_file(file_id: str, request: Request) -> dict:
    await stored.found("delete_file", tenant_principal(request).tenant, file_id, "file", "file_id")
    return {"id": file_id, "object": "file", "deleted": True}


def _expires_after(anchor: str | None, seconds: str | None) -> int:
    """An upload's life in seconds from its ``expires_after[...]`` form fields (checked here,
    not by the form's schema, so that a 400 names the field as the client spelt it)."""
    if anchor is None and seconds is None:
        return BATCH_FILE_TTL_S
    if anchor is None or seconds is None:
        missing = "expires_after[anchor]" if anchor is None else "expires_after[seconds]"
        raise APIError(400, f"expires_after needs both anchor and seconds: send {missing} too", param=missing)
    if anchor != "created_at":
        raise APIError(400, "expires_after[anchor] must be \"created_at\"", param="expires_after[anchor]")
    if not seconds.isdigit() or not TTL_S[0] <= int(seconds) <= TTL_S[1]:
        raise APIError(400, "expires_after[seconds] must be a whole number of seconds from 3600 (1 hour) to "
                       "2592000 (30 days)", param="expires_after[seconds]")
    return int(seconds)


@router.post("/v1/batches", responses=error_responses(400, 401, 404, 429, 503))
async def create_batch(body: BatchCreateRequest, request: Request) -> dict:
    principal = tenant_principal(request)
    meta = await stored.found("file", principal.tenant, body.input_file_id, "file", "input_file_id")
    if meta["purpose"] != "batch":
        raise APIError(400, f"file {body.input_file_id!r} has purpose {meta['purpose']!r}: a batch reads a file "
                       "uploaded with purpose \"batch\"", "invalid_input_file", "input_file_id")
    content = await stored.found("content", principal.tenant, body.input_file_id, "file", "input_file_id")
    now = int(time.time())
    batch = {"id": new_id("batch_"), "object": "batch", "endpoint": body.endpoint, "errors": None,
             "input_file_id": body.input_file_id, "completion_window": body.completion_window,
             "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
             "in_progress_at": None, "expires_at": now + COMPLETION_WINDOW_S[body.completion_window],
             "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
             "cancelling_at": None, "cancelled_at": None, "model": None,
             "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": body.metadata}
    ttl = body.output_expires_after and body.output_expires_after.seconds
    if await stored.call("add_batch", principal.tenant, batch, ttl) is None:
        raise APIError(429, "this tenant has too many batches running: wait for one to end or cancel one",
                       "too_many_batches", headers={"Retry-After": "30"})
    runner = BatchRunner(stored.call, in_process_sender(request.app, bearer_key(request.headers)),
                         principal.tenant, batch, content, metrics=get_metrics())
    task = start_background(runner.run())
    _running.add(task)
    task.add_done_callback(_running.discard)
    return batch


@router.get("/v1/batches", responses=error_responses(401, 503))
async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> dict:
    page, more = await stored.call("batches", tenant_principal(request).tenant, after, limit)
    return list_object(page, more)


@router.get("/v1/batches/{batch_id}", responses=error_responses(401, 404, 503))
async def get_batch(batch_id: str, request: Request) -> dict:
    return await stored.found("batch", tenant_principal(request).tenant, batch_id, "batch", "batch_id")


@router.post("/v1/batches/{batch_id}/cancel", responses=error_responses(401, 404, 503))
async def cancel_batch(batch_id: str, request: Request) -> dict:
    return await stored.found("cancel", tenant_principal(request).tenant, batch_id, "batch", "batch_id")


def in_process_sender(app, key: str | None):
    """``send(url, body)`` for a batch's lines: a POST to ``app`` in this process (httpx's ASGI
    transport, no socket) with the tenant's key, answered as (status, JSON body, headers).
    The key lives only in this runner's memory, for as long as the batch runs: a key revoked
    meanwhile gets the remaining lines 401s, as it would over HTTP."""
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                               base_url="http://kvharbor-batch", timeout=None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def send(url: str, body: dict) -> tuple[int, dict, dict]:
        response = await client.post(url, json=body, headers=headers)
        try:
            answer = response.json()
        except ValueError:
            answer = error_dict(500, response.text[:500] or "no body", "server_error")
        return response.status_code, answer if isinstance(answer, dict) else {"data": answer}, response.headers

    send.aclose = client.aclose        # the runner closes it when the batch ends
    return send


__all__ = ["router", "BatchCreateRequest", "BATCH_ENDPOINTS", "in_process_sender"]
