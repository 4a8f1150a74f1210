"""The gateway's side of sessions: the ``X-Session-ID`` header and ``DELETE /v1/sessions/{id}``.

A session id names one conversation of the calling tenant (the same id from another tenant is
another session). The gateway only checks its syntax and forwards it in
``GenerateRequest.session_id``; the replica that runs the turns keeps the blocks
(``kvharbor.engine.sessions``) and the router sends later turns there.

Ending a session asks every LLM replica (a direct call to each replica actor); the session
is unknown (404) when no replica held it.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import re
import uuid

from pydantic import BaseModel, Field

from kvharbor.platform.error_body import APIError
from kvharbor.platform.json_types import REQUEST_FIELDS

SESSION_HEADER = "X-Session-ID"
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
CALL_TIMEOUT_S = 10.0

logger = logging.getLogger("kvharbor.gateway")


def check_session_id(value: str | None, where: str = SESSION_HEADER) -> str | None:
    """``value`` if it is a valid session id (None stays None); else a 400 naming the rule."""
    if value is None:
        return None
    if not SESSION_ID_RE.match(value):
        raise APIError(400, f"{where} must be 1 to 128 characters: letters, digits and . _ : @ - "
                       "(starting with a letter or digit)", "invalid_session_id", where)
    return value


def session_header(headers) -> str | None:
    """The request's session id from ``X-Session-ID`` (None when absent; 400 when invalid)."""
    values = headers.getlist(SESSION_HEADER) if hasattr(headers, "getlist") else \
        [v for v in [headers.get(SESSION_HEADER)] if v is not None]
    if len(values) > 1:
        raise APIError(400, f"send one {SESSION_HEADER} header, not {len(values)}",
                       "invalid_session_id", SESSION_HEADER)
    return check_session_id(values[0].strip() if values else None)


class ForkRequest(BaseModel):
    """Body of ``POST /v1/sessions/{id}/fork``."""

    model_config = REQUEST_FIELDS
    session_id: str = Field(description="Id of the new session (same rules as X-Session-ID); it "
                                        "starts from the forked session's cached state.")


def _call_every_replica(app_name: str, deployment: str, method: str, *args) -> list:
    """Call ``method(*args)`` on each live replica actor directly (blocking; run in a thread).

    The calls bypass the request router: concurrent handle calls made inside one HTTP request
    share its Serve internal request id, and Serve's router hands a routed replica to the
    pending call with that id, so all but one such call waited until their timeout (seen
    2026-11-23, Ray 2.60; the same cause as the ``n > 1`` hang). A direct actor call is also
    independent of which router the deployment uses. Returns one result (a value, None or
    an exception) per replica.
    """
    import ray  # noqa: PLC0415 - only in a Ray process
    from ray.serve._private.common import RequestMetadata  # noqa: PLC0415

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    refs = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(prefix):
            actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            rid = uuid.uuid4().hex
            meta = RequestMetadata(request_id=rid, internal_request_id=rid, call_method=method,
                                   app_name=app_name)
            refs.append(actor.handle_request.remote(pickle.dumps(meta), *args))
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S) if refs else ([], [])
    done = set(ready)
    results = []
    for ref in refs:
        try:
            results.append(ray.get(ref) if ref in done else TimeoutError("no answer"))
        except Exception as e:  # noqa: BLE001 - reported per replica
            results.append(e)
    return results


async def _on_every_replica(handle, method: str, *args) -> list:
    """Non-None answers of ``method(*args)`` on every replica; 503 when a replica failed and
    none answered."""
    results = await asyncio.to_thread(_call_every_replica, handle.app_name, handle.deployment_name,
                                      method, *args)
    errors = [r for r in results if isinstance(r, BaseException)]
    found = [r for r in results if r is not None and not isinstance(r, BaseException)]
    for error in errors:
        logger.warning("%s call failed: %r", method, error)
    if errors and not found:
        raise APIError(503, "a replica did not answer; retry the request", "replica_unavailable",
                       headers={"Retry-After": "1"})
    return found


async def end_session_everywhere(handle, tenant: str, session_id: str) -> int | None:
    """End the session on every replica. Block references released, None if none held it."""
    found = await _on_every_replica(handle, "end_session", tenant, session_id)
    return sum(found) if found else None


async def flush_everywhere(handle, salts: list | None = None, tenants: list | None = None) -> dict:
    """``flush_cache`` on every replica (all, or only the scopes ``salts`` and the sessions of
    ``tenants``): the summed counts and how many replicas answered."""
    found = await _on_every_replica(handle, "flush_cache", salts, tenants)
    total = {"replicas": len(found)}
    for counts in found:
        for kind, n in counts.items():
            total[kind] = total.get(kind, 0) + n
    return total


class FlushRequest(BaseModel):
    """Body of ``POST /admin/cache/flush`` (optional; none flushes everything). At most one
    filter: ``tenant`` flushes that tenant's cache scope (for a shared or public tenant, the
    whole scope's blocks) and ends that tenant's sessions; ``scope`` (``shared:<group>`` or
    ``public``) flushes that scope and ends its members' sessions."""

    model_config = REQUEST_FIELDS
    tenant: str | None = Field(None, min_length=1, max_length=128)
    scope: str | None = Field(None, pattern=r"^(public|shared:[A-Za-z0-9][A-Za-z0-9_.-]{0,63})$")


def flush_filter(registry, body: FlushRequest | None) -> tuple[dict, list | None, list | None]:
    """``(filter echoed in the reply, salts, tenants)`` for a flush body; ``(…, None, None)``
    flushes everything. Raises APIError 400 (both filters) or 404 (no such tenant / scope)."""
    if body is None or (body.tenant is None and body.scope is None):
        return {}, None, None
    if body.tenant is not None and body.scope is not None:
        raise APIError(400, "give either tenant or scope, not both", "invalid_request_error", param="scope")
    tenants = registry.config.tenants
    if body.tenant is not None:
        if body.tenant not in tenants:
            raise APIError(404, f"no tenant {body.tenant!r}", "tenant_not_found", param="tenant")
        return {"tenant": body.tenant}, [registry.cache_salt(body.tenant)], [body.tenant]
    members = [n for n, t in tenants.items() if t.cache_scope == body.scope]
    if not members:
        raise APIError(404, f"no tenant uses cache scope {body.scope!r}", "scope_not_found", param="scope")
    return {"scope": body.scope}, [registry.cache_salt(members[0])], members


async def fork_session_everywhere(handle, tenant: str, source: str, target: str) -> int:
    """Fork ``source`` into ``target`` on the replica(s) holding it: blocks the new session
    holds. 404 when no replica holds ``source``; 409 when ``target`` exists there."""
    found = await _on_every_replica(handle, "fork_session", tenant, source, target)
    if not found:
        raise APIError(404, f"no session {source!r} of this tenant is held (never used, already "
                       "ended or expired)", "session_not_found", "session_id")
    refused = [f["error"] for f in found if "error" in f]
    if refused:
        raise APIError(409, refused[0], "session_exists", "session_id")
    return sum(f["blocks"] for f in found)
