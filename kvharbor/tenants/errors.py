"""Errors a client can cause, each carrying the HTTP status the gateway should answer with.

The gateway maps them one to one: ``raise HTTPException(err.status, err.message)`` or an
OpenAI-style body ``{"error": {"message": err.message, "type": err.code}}``. Messages say what
to change and never contain an API key.
"""

from __future__ import annotations


class TenantError(Exception):
    """Base class: ``status`` is the HTTP status, ``code`` a stable machine-readable reason."""

    status: int = 400
    code: str = "invalid_request_error"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class AuthError(TenantError):
    """401: missing, unknown, expired or revoked API key."""

    status = 401
    code = "invalid_api_key"


class ForbiddenError(TenantError):
    """403: the key is valid but may not do this (e.g. use this model, reach /admin)."""

    status = 403
    code = "permission_denied"
