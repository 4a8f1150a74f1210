"""A gateway applies tenants.yaml edits made before its first call to that call.

A gateway that had served nothing yet used to start watching the file at its first call and
look at it one watch period later, so that call (and all others in that second) ran on the
configuration it was constructed with: a revoked key still authenticated, and a raised limit
still refused (the soak test once saw a batch tenant's old ``max_concurrent_requests`` 8 on
the second of two gateways).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvharbor.platform.gateway import Gateway
from kvharbor.tenants import AuthError, TenantRegistry
from kvharbor.tenants.keys import hash_key

from .test_registry import KEYS, write


def fresh_gateway(path, clock) -> SimpleNamespace:
    """The parts of a constructed Gateway that ``_gate`` uses, before any call."""
    gw = SimpleNamespace(registry=TenantRegistry(path, clock=clock), _watcher=None)
    gw._start_watcher = lambda: Gateway._start_watcher(gw)
    return gw


def first_call(gw: SimpleNamespace, key: str):
    """The gateway's first call's key check (``_gate``), on a loop (its watcher starts there)."""
    async def call():
        try:
            return Gateway._gate(gw, key, "/v1/models")
        finally:
            gw._watcher.cancel()

    return asyncio.run(call())


def test_a_key_revoked_before_a_gateways_first_call_is_refused_by_it(tmp_path, clock):
    path = tmp_path / "t.yaml"
    write(path)
    gw = fresh_gateway(path, clock)
    assert gw.registry.authenticate(KEYS["bob"]).tenant == "bob"
    text = path.read_text().replace(hash_key(KEYS["bob"]), hash_key("kvh-test-bob-rotated"))
    path.write_text(text)                        # another mtime than the load's (``write``)

    with pytest.raises(AuthError):
        first_call(gw, KEYS["bob"])
    assert gw.registry.version == 2


def test_a_limit_raised_before_a_gateways_first_call_applies_to_it(tmp_path, clock):
    path = tmp_path / "t.yaml"
    write(path, bob_rpm=30)
    gw = fresh_gateway(path, clock)
    write(path, bob_rpm=99)

    assert first_call(gw, KEYS["bob"]).limits.requests_per_minute == 99
