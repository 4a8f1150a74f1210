"""API keys: compared in constant time, never echoed or logged; admin routes need an admin key."""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

import httpx
import pytest

from kvharbor.tenants import AuthError, TenantRegistry
from kvharbor.tenants import keys as keys_module
from kvharbor.tenants import registry as registry_module
from kvharbor.tenants.keys import DEMO_KEYS, hash_key, key_matches
from tests.reliability.helpers import DEMO, ray_log_files

REPO = Path(__file__).resolve().parents[2]
CANARY = "kvh-canary-Zq8vW3xLr0Pa9SeCr3T"          # a wrong key we look for in every log


@pytest.fixture
def registry(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text((REPO / "tenants.yaml").read_text())
    return TenantRegistry(path)


_compare_digest = hmac.compare_digest


def _spy_compare(monkeypatch, module) -> list[tuple]:
    calls = []

    def spy(a, b):
        calls.append((a, b))
        return _compare_digest(a, b)

    monkeypatch.setattr(module.hmac, "compare_digest", spy)
    return calls


def test_key_checks_compare_digests_in_constant_time(monkeypatch, registry):
    calls = _spy_compare(monkeypatch, keys_module)
    assert key_matches(DEMO["premium"], DEMO_KEYS[DEMO["premium"]])
    assert calls == [(hash_key(DEMO["premium"]), DEMO_KEYS[DEMO["premium"]])]
    calls = _spy_compare(monkeypatch, registry_module)
    assert registry.authenticate(DEMO["premium"]).tenant == "acme"
    assert registry.is_admin(DEMO["admin"])
    assert len(calls) == 2
    assert all(DEMO["premium"] not in pair and DEMO["admin"] not in pair for pair in calls)


def test_auth_failures_neither_echo_nor_log_the_key(registry, caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(AuthError) as info:
        registry.authenticate(CANARY)
    assert CANARY not in str(info.value) and CANARY not in info.value.message
    assert not registry.is_admin(CANARY)
    assert all(CANARY not in rec.getMessage() for rec in caplog.records)


def test_http_errors_never_echo_the_key(kvharbor_app):
    base, auth = kvharbor_app.base_url, {"Authorization": f"Bearer {CANARY}"}
    answers = [httpx.post(base + "/v1/completions", headers=auth, json={"model": kvharbor_app.model, "prompt": "x"}),
               httpx.post(base + "/v1/chat/completions", headers=auth, json={"model": "nope", "messages": []}),
               httpx.get(base + "/v1/models", headers=auth),
               httpx.get(base + "/admin/tenants", headers=auth),
               httpx.get(base + "/admin/tenants/status", headers=auth)]
    for r in answers:
        assert CANARY not in r.text and CANARY not in str(r.headers)
    assert [r.status_code for r in answers] == [401] * 5      # the key first, then the body


def test_no_process_log_contains_a_plaintext_key(kvharbor_app):
    """The gateway, proxy and replica logs of this Ray session never hold a presented key."""
    httpx.get(kvharbor_app.base_url + "/v1/models", headers={"Authorization": f"Bearer {CANARY}"})
    files = ray_log_files()
    assert any("Gateway" in p.name for p in files), "no gateway log found to inspect"
    secrets = [CANARY, *DEMO.values()]
    for path in files:
        text = path.read_bytes().decode("utf-8", "replace")
        for secret in secrets:
            assert secret not in text, f"{secret[:8]}... appears in {path}"


def test_admin_routes_need_an_admin_key(kvharbor_app):
    base = kvharbor_app.base_url

    def get(path: str, key: str | None) -> httpx.Response:
        return httpx.get(base + path, headers={"Authorization": f"Bearer {key}"} if key else {})

    for path in ("/admin/tenants", "/admin/tenants/status"):
        r = get(path, None)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    denied = get("/admin/tenants/status", DEMO["standard"])
    assert denied.status_code == 403 and "admin key" in denied.json()["error"]["message"]
    assert get("/admin/tenants/status", DEMO["admin"]).status_code == 200
    # a tenant key sees only its own tenant on /admin/tenants, never the others
    own = get("/admin/tenants", DEMO["standard"]).json()["tenants"]
    assert list(own) == ["globex"]
    assert {"acme", "globex", "initech"} <= set(get("/admin/tenants", DEMO["admin"]).json()["tenants"])


def test_tenants_show_reads_the_admin_key_from_a_file(tmp_path, monkeypatch):
    """The admin key need not be on the command line (where `ps` shows it)."""
    from kvharbor.tenants import cli

    seen = []
    monkeypatch.setattr(cli, "_fetch_usage", lambda url, key: seen.append(key) or {})
    key_file = tmp_path / "admin.key"
    key_file.write_text(CANARY + "\n")
    cli.main(["show", "--file", str(REPO / "tenants.yaml"), "--usage-url", "http://127.0.0.1:9",
              "--admin-key-file", str(key_file)])
    assert seen == [CANARY]

