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

from kvharbor.platform.openai_protocol import APIError

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


def _end_on_every_replica(app_name: str, deployment: str, tenant: str, session_id: str) -> list:
    """Call ``end_session`` on each live replica actor directly (blocking; run in a thread).

    The calls bypass the request router on purpose: a call pinned to one replica through the
    router (``replica_id=``) was seen to wait until its timeout when made from a gateway
    replica (2026-11-23, Ray 2.60), while a direct actor call always arrives. Returns one
    result (int, None or an exception) per replica.
    """
    import ray  # noqa: PLC0415 - only in a Ray process
    from ray.serve._private.common import RequestMetadata  # noqa: PLC0415

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    refs = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(prefix):
            actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            rid = uuid.uuid4().hex
            meta = RequestMetadata(request_id=rid, internal_request_id=rid, call_method="end_session",
                                   app_name=app_name)
            refs.append(actor.handle_request.remote(pickle.dumps(meta), tenant, session_id))
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S) if refs else ([], [])
    done = set(ready)
    results = []
    for ref in refs:
        try:
            results.append(ray.get(ref) if ref in done else TimeoutError("no answer"))
        except Exception as e:  # noqa: BLE001 - reported per replica
            results.append(e)
    return results


async def end_session_everywhere(handle, tenant: str, session_id: str) -> int | None:
    """End the session on every replica. Block references released, None if none held it."""
    results = await asyncio.to_thread(_end_on_every_replica, handle.app_name, handle.deployment_name,
                                      tenant, session_id)
    errors = [r for r in results if isinstance(r, BaseException)]
    found = [r for r in results if isinstance(r, int)]
    for error in errors:
        logger.warning("end_session call failed: %r", error)
    if errors and not found:
        raise APIError(503, "a replica did not answer while ending the session; retry the request",
                       "replica_unavailable", headers={"Retry-After": "1"})
    return sum(found) if found else None
