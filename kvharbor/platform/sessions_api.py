"""The gateway's side of sessions: the ``X-Session-ID`` header and ``DELETE /v1/sessions/{id}``.

A session id names one conversation of the calling tenant (the same id from another tenant is
another session). The gateway only checks its syntax and forwards it in
``GenerateRequest.session_id``; the replica that runs the turns keeps the blocks
(``kvharbor.engine.sessions``) and the router sends later turns there.

Ending a session asks every LLM replica (each call pinned with ``replica_id=``, which the
KV-aware router honours); the session is unknown (404) when no replica held it.
"""

from __future__ import annotations

import asyncio
import re

from kvharbor.platform.openai_protocol import APIError

SESSION_HEADER = "X-Session-ID"
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
CALL_TIMEOUT_S = 10.0


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


def _replica_ids(app_name: str, deployment: str) -> list[str]:
    """Unique ids of the deployment's live replicas (from Serve's named actors)."""
    import ray  # noqa: PLC0415 - only in a Ray process

    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(n[len(prefix):] for n in names if n.startswith(prefix))


async def end_session_everywhere(handle, tenant: str, session_id: str) -> int | None:
    """End the session on every replica. Block references released, None if none held it."""
    ids = await asyncio.to_thread(_replica_ids, handle.app_name, handle.deployment_name)
    calls = [asyncio.wait_for(handle.end_session.remote(tenant, session_id, replica_id=uid),
                              CALL_TIMEOUT_S) for uid in ids]
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    found = [r for r in results if isinstance(r, int)]
    if errors and not found:
        raise APIError(503, "a replica did not answer while ending the session; retry the request",
                       "replica_unavailable", headers={"Retry-After": "1"})
    return sum(found) if found else None
