"""TenantRegistry: demo keys work, bad keys get 401, models 403, hot reload keeps a valid config."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvharbor.tenants import AuthError, ForbiddenError, TenantRegistry, TenantsFileError
from kvharbor.tenants.keys import DEMO_KEYS, hash_key
from tests.conftest import until

from .conftest import T0

FILE = """\
qos_classes:
  gold: {{priority: 10, pinned: true}}
  tin: {{priority: 1}}
admin_keys: ["{admin}"]
tenants:
  alice:
    qos: gold
    keys:
      - hash: "{live}"
      - hash: "{old}"
        expires: 2027-01-15T07:00:00Z
      - hash: "{future}"
        expires: 2027-01-15T09:00:00Z
      - hash: "{gone}"
        revoked: leaked in a screenshot
    allowed_models: [small-model]
    pinned_kv_blocks: 12
  bob:
    qos: tin
    keys: ["{bob}"]
    cache_scope: shared:team
    requests_per_minute: {bob_rpm}
  carol:
    qos: tin
    keys: ["{carol}"]
    cache_scope: public
"""
KEYS = {name: f"kvh-test-{name}" for name in ("admin", "live", "old", "future", "gone", "bob",
                                              "carol")}


def write(path: Path, bob_rpm: int = 30, extra: str = "") -> None:
    text = FILE.format(bob_rpm=bob_rpm, **{n: hash_key(k) for n, k in KEYS.items()}) + extra
    path.write_text(text)
    st = path.stat()            # make the change visible even within one mtime tick
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.fixture
def registry(tmp_path, clock):
    path = tmp_path / "t.yaml"
    write(path)
    return TenantRegistry(path, clock=clock)


def test_demo_keys_authenticate_to_their_tenants(tenants_file):
    reg = TenantRegistry(tenants_file)
    classes = {reg.authenticate(k).qos_name for k in DEMO_KEYS if k != "kvh-demo-admin"}
    assert classes == {"premium", "standard", "batch"}
    assert reg.is_admin("kvh-demo-admin")
    assert not reg.is_admin("kvh-demo-premium")
    assert reg.active_demo_keys() == ["acme", "admin", "globex", "initech"]
    assert reg.pinned_kv_blocks_total() == 64


def test_principal_carries_class_limits_and_salt(registry):
    p = registry.authenticate(KEYS["live"])
    assert (p.tenant, p.qos_name, p.qos.priority, p.cache_salt) == ("alice", "gold", 10,
                                                                    "tenant:alice")
    assert registry.authenticate(KEYS["bob"]).limits.requests_per_minute == 30
    assert p.key_id == hash_key(KEYS["live"])[:8]


@pytest.mark.parametrize("key,code,words", [
    (None, "invalid_api_key", "missing API key"),
    ("", "invalid_api_key", "missing API key"),
    ("kvh-nobody", "invalid_api_key", "invalid API key"),
    (KEYS["old"], "expired_api_key", "expired"),
    (KEYS["gone"], "revoked_api_key", "revoked"),
])
def test_unusable_keys_are_401(registry, key, code, words):
    with pytest.raises(AuthError) as info:
        registry.authenticate(key)
    assert info.value.status == 401 and info.value.code == code
    assert words in info.value.message


def test_key_expires_when_the_clock_passes_its_expiry(registry, clock):
    assert registry.authenticate(KEYS["future"]).tenant == "alice"
    clock.now = T0 + 3600
    with pytest.raises(AuthError, match="expired"):
        registry.authenticate(KEYS["future"])


def test_admin_keys_are_separate_from_tenant_keys(registry):
    assert registry.is_admin(KEYS["admin"])
    assert not registry.is_admin(KEYS["live"]) and not registry.is_admin(None)
    with pytest.raises(AuthError):
        registry.authenticate(KEYS["admin"])


def test_an_admin_key_stops_being_admin_when_it_expires_or_is_revoked(tmp_path, clock):
    path = tmp_path / "t.yaml"
    write(path)
    text = path.read_text().replace(
        f'admin_keys: ["{hash_key(KEYS["admin"])}"]',
        f'admin_keys:\n  - hash: "{hash_key(KEYS["admin"])}"\n    expires: 2027-01-15T09:00:00Z\n'
        f'  - hash: "{hash_key("kvh-test-admin2")}"\n    revoked: rotated')
    path.write_text(text)
    registry = TenantRegistry(path, clock=clock)
    assert registry.is_admin(KEYS["admin"]) and not registry.is_admin("kvh-test-admin2")
    clock.now = T0 + 3601                            # past 09:00 UTC
    assert not registry.is_admin(KEYS["admin"])


def test_disallowed_model_is_403(registry):
    alice = registry.authenticate(KEYS["live"])
    registry.check_model(alice, "small-model")
    with pytest.raises(ForbiddenError) as info:
        registry.check_model(alice, "big-model")
    assert info.value.status == 403 and "small-model" in info.value.message
    registry.check_model(registry.authenticate(KEYS["bob"]), "big-model")  # no list: all


def test_cache_salts_follow_scope(registry):
    assert registry.cache_salt("alice") == "tenant:alice"
    assert registry.cache_salt("bob") == "group:team"
    assert registry.cache_salt("carol") is None
    assert registry.pinned_kv_blocks_total() == 12


def test_unchanged_file_does_not_reload(registry):
    assert registry.reload_if_changed() is False
    assert registry.version == 1


def test_valid_change_is_picked_up(registry, clock):
    seen = []
    registry.add_listener(lambda config, version: seen.append(version))
    write(registry.path, bob_rpm=99)
    clock.now = T0 + 5
    assert registry.reload_if_changed() is True
    assert registry.authenticate(KEYS["bob"]).limits.requests_per_minute == 99
    assert registry.version == 2 and seen == [2]
    assert registry.status()["loaded_at"] == T0 + 5
    assert registry.reload_if_changed() is False


def test_invalid_change_is_rejected_and_old_config_stays(registry, clock, caplog):
    write(registry.path, bob_rpm=99, extra="  dave:\n    qos: platinum\n")
    clock.now = T0 + 7
    with caplog.at_level(logging.ERROR):
        assert registry.reload_if_changed() is False
    assert registry.authenticate(KEYS["bob"]).limits.requests_per_minute == 30
    status = registry.status()
    assert status["version"] == 1 and status["last_error_at"] == T0 + 7
    assert "tenants.dave.qos" in status["last_error"] and "platinum" in status["last_error"]
    assert status["path"] == str(registry.path)
    assert "platinum" in caplog.text
    caplog.clear()
    assert registry.reload_if_changed() is False       # same bad content: not logged again
    assert caplog.text == ""
    write(registry.path, bob_rpm=45)                  # fixed: picked up, error cleared
    assert registry.reload_if_changed() is True
    assert registry.status()["last_error"] is None and registry.version == 2


def test_deleted_file_keeps_config(registry, caplog):
    registry.path.unlink()
    with caplog.at_level(logging.ERROR):
        assert registry.reload_if_changed() is False
        assert registry.reload_if_changed() is False
    assert registry.authenticate(KEYS["live"]).tenant == "alice"
    assert "cannot read" in registry.status()["last_error"]
    assert caplog.text.count("tenants file rejected") == 1          # once, not at every poll


def test_a_file_that_cannot_be_read_keeps_config_and_says_why(registry, monkeypatch, caplog):
    write(registry.path, bob_rpm=46)                                 # changed, but unreadable

    def unreadable() -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(registry, "_read", unreadable)
    with caplog.at_level(logging.ERROR):
        assert registry.reload_if_changed() is False
    assert registry.version == 1 and registry.authenticate(KEYS["bob"]).limits.requests_per_minute == 30
    assert "cannot read" in registry.status()["last_error"] and "Permission denied" in caplog.text


def test_an_unchanged_stat_costs_no_read_and_a_rejected_text_no_parse(registry, clock, monkeypatch):
    import kvharbor.tenants.registry as module

    with monkeypatch.context() as m:
        m.setattr(registry, "_read", lambda: pytest.fail("read although nothing changed"))
        assert registry.reload_if_changed() is False
    parses = []
    parse = module.parse_tenants_text
    monkeypatch.setattr(module, "parse_tenants_text", lambda *a: parses.append(1) or parse(*a))
    write(registry.path, extra="  dave:\n    qos: platinum\n")
    clock.now = T0 + 7
    assert registry.reload_if_changed() is False and parses == [1]
    write(registry.path, extra="  dave:\n    qos: platinum\n")       # touched: the same bad text
    clock.now = T0 + 9
    assert registry.reload_if_changed() is False and parses == [1]
    assert registry.status()["last_error_at"] == T0 + 7


def test_a_file_restored_after_an_error_clears_it_and_the_error_counts_again_later(registry, caplog):
    bad = "  dave:\n    qos: platinum\n"
    write(registry.path, extra=bad)
    assert registry.reload_if_changed() is False and registry.status()["last_error"]
    write(registry.path)                                             # the applied text again
    assert registry.reload_if_changed() is False and registry.version == 1
    assert registry.status()["last_error"] is None
    write(registry.path, extra=bad)                                  # broken again: reported again
    assert registry.reload_if_changed() is False and "platinum" in registry.status()["last_error"]
    write(registry.path, bob_rpm=45)                                 # a new text: applied
    assert registry.reload_if_changed() is True
    with caplog.at_level(logging.ERROR):
        write(registry.path, extra=bad)                              # the old bad text, once more
        assert registry.reload_if_changed() is False
    assert "platinum" in registry.status()["last_error"] and "platinum" in caplog.text


def test_pinned_blocks_add_up_and_only_tenants_with_prefixes_are_listed(tmp_path, clock):
    path = tmp_path / "t.yaml"
    write(path, extra="  dave:\n    qos: gold\n    pinned_kv_blocks: 4\n"
                      "    pinned_prefixes: [You are Dave's assistant.]\n")
    registry = TenantRegistry(path, clock=clock)
    assert registry.pinned_kv_blocks_total() == 12 + 4
    assert registry.pinned_prefixes() == {"dave": ["You are Dave's assistant."]}


def test_an_expired_demo_key_is_not_reported_active(tmp_path, clock):
    """``/admin/tenants/status`` warns while a public demo key still works; an expired one
    (tenant's or admin's) no longer does."""
    premium, admin = DEMO_KEYS["kvh-demo-premium"], DEMO_KEYS["kvh-demo-admin"]     # their hashes
    path = tmp_path / "t.yaml"
    expired = "expires: 2027-01-15T07:00:00Z"                         # before the clock's T0
    path.write_text(f"""\
qos_classes: {{gold: {{priority: 10}}}}
admin_keys: [{{hash: "{admin}", {expired}}}]
tenants:
  acme:
    qos: gold
    keys: [{{hash: "{premium}", {expired}}}]
""")
    assert TenantRegistry(path, clock=clock).active_demo_keys() == []
    path.write_text(path.read_text().replace(expired, "label: demo"))
    assert TenantRegistry(path, clock=clock).active_demo_keys() == ["acme", "admin"]


def test_invalid_or_missing_file_at_startup_raises(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("qos_classes: {}\n")
    with pytest.raises(TenantsFileError, match="bad.yaml:1: qos_classes"):
        TenantRegistry(path)
    with pytest.raises(TenantsFileError, match="cannot read"):
        TenantRegistry(tmp_path / "missing.yaml")


def test_describe_is_json_safe_and_shows_key_ids_only(registry):
    import json

    text = json.dumps(registry.describe())
    view = json.loads(text)
    assert view["bob"]["limits"]["requests_per_minute"] == 30
    assert view["carol"]["cache_salt"] is None
    assert [k["id"] for k in view["alice"]["keys"]] == [hash_key(KEYS[n])[:8] for n in
                                                         ("live", "old", "future", "gone")]
    assert view["alice"]["keys"][3]["revoked"] == "leaked in a screenshot"
    assert view["alice"]["keys"][0]["revoked"] is False
    assert (view["alice"]["allowed_models"], view["bob"]["allowed_models"]) == (["small-model"], "all")
    assert not any(hash_key(k) in text or k in text for k in KEYS.values())


def test_keys_never_appear_in_logs(registry, caplog):
    with caplog.at_level(logging.DEBUG):
        for key in KEYS.values():
            try:
                registry.authenticate(key)
            except AuthError as exc:
                assert key not in exc.message
        registry.is_admin(KEYS["admin"])
        write(registry.path, extra="  eve:\n    qos: tin\n    keys: [\"kvh-plaintext-oops\"]\n")
        registry.reload_if_changed()
        assert "keys.0" in registry.status()["last_error"]
        assert "kvh-plaintext-oops" not in str(registry.status())
        write(registry.path, bob_rpm=31)
        registry.reload_if_changed()
    assert len(caplog.records) >= 2, "expected the reject and reload messages"
    for key in [*KEYS.values(), "kvh-plaintext-oops"]:
        assert key not in caplog.text


def test_watch_task_reloads_in_the_background(registry):
    import asyncio

    async def scenario() -> int:
        task = asyncio.create_task(registry.watch(interval_s=0.01))
        write(registry.path, bob_rpm=77)
        await until(lambda: registry.version == 2)
        task.cancel()
        return registry.authenticate(KEYS["bob"]).limits.requests_per_minute

    assert asyncio.run(scenario()) == 77


def test_watch_polls_once_an_interval(registry, monkeypatch):
    """Not one poll after another: a poll is a stat in a worker thread, every interval."""
    import asyncio

    polls = []
    monkeypatch.setattr(registry, "reload_if_changed", lambda: polls.append(1) or False)

    async def scenario() -> None:
        task = asyncio.create_task(registry.watch(interval_s=0.05))
        await asyncio.sleep(0.3)
        task.cancel()

    asyncio.run(scenario())
    assert 2 <= len(polls) <= 6, len(polls)


def test_watch_stops_quietly_once_the_thread_pool_is_shut_down(registry, caplog):
    """A process that is exiting (Serve stopping a gateway) shuts its loop's thread pool down;
    the watcher then returns instead of logging a stack trace every interval until exit."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    async def scenario() -> None:
        pool = ThreadPoolExecutor(1)
        asyncio.get_running_loop().set_default_executor(pool)
        pool.shutdown()
        await asyncio.wait_for(registry.watch(interval_s=0.01), timeout=5)

    with caplog.at_level(logging.DEBUG, logger="kvharbor"):
        asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_watch_still_logs_a_failing_listener_and_goes_on(registry, caplog):
    import asyncio

    calls = []

    def broken(config, version) -> None:
        calls.append(version)
        raise RuntimeError("listener bug")

    registry.add_listener(broken)

    async def scenario() -> None:
        task = asyncio.create_task(registry.watch(interval_s=0.01))
        write(registry.path, bob_rpm=78)
        await until(lambda: calls)
        write(registry.path, bob_rpm=79)
        await until(lambda: registry.version == 3)
        task.cancel()

    asyncio.run(scenario())
    assert registry.version == 3 and calls[:2] == [2, 3]
    assert "tenants reload listener failed" in caplog.text


def test_sha256_names_the_applied_file_the_same_in_every_process(registry, tmp_path, clock):
    import hashlib

    def digest() -> str:
        return hashlib.sha256(registry.path.read_bytes()).hexdigest()

    first = digest()
    assert registry.sha256 == first == TenantRegistry(registry.path, clock=clock).sha256
    write(registry.path, bob_rpm=99)
    assert registry.sha256 == first                     # not applied yet
    registry.reload_if_changed()
    assert registry.sha256 == digest() != first
    assert registry.status()["sha256"] == registry.sha256
    later = TenantRegistry(registry.path, clock=clock)   # a process started after: version 1
    assert later.sha256 == registry.sha256 and later.version == 1 != registry.version
    registry.path.write_text("tenants: [unclosed")
    registry.reload_if_changed()                        # rejected: the applied file stays named
    assert registry.sha256 == later.sha256


def test_lora_adapters_resolve_from_the_files_directory_and_must_exist(tenants_file, tmp_path):
    """A relative adapter path is read from tenants.yaml's directory; a directory without an
    adapter_config.json is refused with the field and its line, and the old config stays."""
    import yaml

    from kvharbor.tenants.loader import load_tenants_file

    (tenants_file.parent / "adapters" / "a").mkdir(parents=True)
    (tenants_file.parent / "adapters" / "a" / "adapter_config.json").write_text("{}")
    data = yaml.safe_load(tenants_file.read_text())
    data["lora_adapters"] = {"a": {"path": "adapters/a"}}
    tenants_file.write_text(yaml.safe_dump(data, sort_keys=False))
    registry = TenantRegistry(tenants_file)
    assert registry.lora_adapters() == {"a": str(tenants_file.parent / "adapters" / "a")}
    data["lora_adapters"]["b"] = {"path": str(tmp_path / "nowhere")}
    tenants_file.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(TenantsFileError) as info:
        load_tenants_file(tenants_file)
    issue = info.value.issues[0]
    assert issue.path == "lora_adapters.b.path" and issue.line and "holds no adapter_config.json" in issue.message
    assert not registry.reload_if_changed() and list(registry.lora_adapters()) == ["a"]
