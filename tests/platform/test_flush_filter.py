"""POST /admin/cache/flush body -> which cache scopes and sessions a flush drops (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvharbor.platform.error_body import APIError
from kvharbor.platform.sessions_api import FlushRequest, flush_filter
from kvharbor.tenants import TenantRegistry

EXAMPLE = Path(__file__).resolve().parents[2] / "tenants.yaml"


@pytest.fixture
def registry() -> TenantRegistry:
    return TenantRegistry(EXAMPLE)


def test_no_filter_flushes_everything(registry):
    assert flush_filter(registry, None) == ({}, None, None)
    assert flush_filter(registry, FlushRequest()) == ({}, None, None)


def test_tenant_filter_is_that_tenants_scope_and_sessions(registry):
    assert flush_filter(registry, FlushRequest(tenant="acme")) == \
        ({"tenant": "acme"}, [registry.cache_salt("acme")], ["acme"])
    echo, salts, tenants = flush_filter(registry, FlushRequest(tenant="globex"))
    assert salts == ["group:partners"] and tenants == ["globex"]


def test_scope_filter_ends_every_members_sessions(registry):
    echo, salts, tenants = flush_filter(registry, FlushRequest(scope="shared:partners"))
    assert echo == {"scope": "shared:partners"} and salts == ["group:partners"]
    assert sorted(tenants) == ["globex", "initech"]


@pytest.mark.parametrize("body, status, code", [
    (FlushRequest(tenant="acme", scope="public"), 400, "invalid_request_error"),
    (FlushRequest(tenant="nobody"), 404, "tenant_not_found"),
    (FlushRequest(scope="public"), 404, "scope_not_found"),        # no public tenant in the file
])
def test_bad_filters_are_client_errors(registry, body, status, code):
    with pytest.raises(APIError) as e:
        flush_filter(registry, body)
    assert (e.value.status, e.value.code) == (status, code)


def test_scope_syntax_and_unknown_fields_are_refused():
    for bad in ({"scope": "team"}, {"scope": "private"}, {"tenants": ["acme"]}):
        with pytest.raises(ValidationError):
            FlushRequest(**bad)
