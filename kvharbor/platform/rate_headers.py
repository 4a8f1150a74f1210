"""OpenAI's rate-limit headers on every answer of a route that admits requests.

A client paces itself from what each answer says of its limits, as with OpenAI's API::

    x-ratelimit-limit-requests: 600        the tenant's requests_per_minute
    x-ratelimit-limit-tokens: 200000       its tokens_per_minute (prompt + n x max_tokens)
    x-ratelimit-remaining-requests: 587    left in the bucket right after this request
    x-ratelimit-remaining-tokens: 196113
    x-ratelimit-reset-requests: 1.3s       until the bucket is full again at its refill rate
    x-ratelimit-reset-tokens: 1m10s

The limits come from the key's tenant (``principal.limits``) and are sent with every answer a
generation route's handler gives, a 429 or 400 included (not with the key check's own
refusals: 401, or the overload guard's 429). ``remaining`` and ``reset`` come from the admission
service's answer for this very request (``Admission.rates``), so they are exact across gateway
replicas; an answer the service did not decide has none: a request refused before admission
(a bad body, a full class queue, a refusal the gateway remembers) and a pinned-class request
admitted from its gateway's share of the limits (``fast_lane``, no call). The service's
``remaining`` does not count units gateways hold for pinned classes' fast lane, so for those
tenants it is a lower bound.

``AuthGateMiddleware`` opens a record per request (``opened``) and adds the headers to the
response's start (``headers_for``); ``Admitter.admit`` notes the service's answer (``note``).
The record is a context variable: the route handler runs in the middleware's context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_RATES: ContextVar[dict | None] = ContextVar("kvharbor_rate_state", default=None)

LIMIT_FIELDS = (("requests", "requests_per_minute"), ("tokens", "tokens_per_minute"))


@contextmanager
def opened() -> Iterator[dict]:
    """A fresh record for the request served inside the block (``note`` fills it)."""
    record: dict = {}
    token = _RATES.set(record)
    try:
        yield record
    finally:
        _RATES.reset(token)


def note(rates: dict | None) -> None:
    """The admission service's ``{"requests": (remaining, reset_s), "tokens": (...)}`` for
    the request being served (nothing outside a request the middleware opened)."""
    record = _RATES.get()
    if record is not None and rates:
        record.update(rates)


def duration(seconds: float) -> str:
    """OpenAI's form: ``20ms``, ``1.3s``, ``6m0s``, ``1h2m5s``. Each range rounds to its own
    precision first, so a value that rounds up reads in the next range (59.6 s is ``1m0s``)."""
    millis = max(0, round(seconds * 1000))
    if millis < 1000:
        return f"{millis}ms"
    short = float(f"{seconds:.3g}")
    if short < 10:
        return f"{short:g}s"
    minutes, secs = divmod(round(seconds), 60)
    if not minutes:
        return f"{secs}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{secs}s" if hours else f"{minutes}m{secs}s"


def headers_for(limits, record: dict) -> list[tuple[bytes, bytes]]:
    """The ``x-ratelimit-*`` headers of one answer: the tenant's ``limits``, and what
    ``record`` holds of the service's answer for this request."""
    out = []
    for unit, field in LIMIT_FIELDS:
        cap = getattr(limits, field, None)
        if cap is None:
            continue
        out.append((f"x-ratelimit-limit-{unit}".encode(), str(cap).encode()))
        if unit in record:
            remaining, reset_s = record[unit]
            out.append((f"x-ratelimit-remaining-{unit}".encode(), str(remaining).encode()))
            out.append((f"x-ratelimit-reset-{unit}".encode(), duration(reset_s).encode()))
    return out


__all__ = ["duration", "headers_for", "note", "opened"]
