"""`kvharbor tenants ...`: edits keep comments, keys are printed once and stored hashed."""

from __future__ import annotations

import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from kvharbor.tenants import AuthError, TenantRegistry
from kvharbor.tenants.cli import main
from kvharbor.tenants.keys import hash_key

KEY_RE = re.compile(r"API key \(shown once; store it now\): (kvh-\S+)")


def comments(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("#")]


def new_key(out: str) -> str:
    keys = KEY_RE.findall(out)
    assert len(keys) == 1, out
    return keys[0]


def break_initech_qos(tenants_file) -> tuple[str, int]:
    """Give initech an unknown QoS class ('bulk'): the file's new text and that line's number."""
    text = tenants_file.read_text().replace("qos: batch", "qos: bulk")
    tenants_file.write_text(text)
    return text, text.splitlines().index("    qos: bulk") + 1


def test_validate_ok_prints_summary(tenants_file, capsys):
    assert main(["validate", str(tenants_file)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "tenants: 3" in out and "demo keys" in out
    assert "    acme: qos=premium keys=1 cache_scope=private" in out.splitlines()


def test_validate_reports_file_line_and_field(tenants_file, capsys):
    _, line = break_initech_qos(tenants_file)
    assert main(["validate", str(tenants_file)]) == 1
    err = capsys.readouterr().err
    assert f"{tenants_file}:{line}: tenants.initech.qos: unknown QoS class 'bulk'" in err
    assert err.rstrip().endswith(f"{tenants_file}: INVALID (1 problem(s))")


def test_add_rotate_revoke_round_trip_keeps_comments(tenants_file, capsys):
    original = tenants_file.read_text()
    f = ["--file", str(tenants_file)]
    assert main(["add", "hooli", "--qos", "standard", "--cache-scope", "shared:partners",
                 "--requests-per-minute", "7", *f]) == 0
    first = new_key(capsys.readouterr().out)
    assert first not in tenants_file.read_text() and hash_key(first) in tenants_file.read_text()
    reg = TenantRegistry(tenants_file)
    p = reg.authenticate(first)
    assert (p.tenant, p.qos_name, p.cache_salt, p.limits.requests_per_minute) == \
        ("hooli", "standard", "group:partners", 7)

    assert main(["rotate-key", "hooli", *f]) == 0
    out = capsys.readouterr().out
    second = new_key(out)
    assert f"old key {hash_key(first)[:8]}: expires" in out
    reg = TenantRegistry(tenants_file)
    assert reg.authenticate(second).tenant == "hooli"
    assert reg.authenticate(first).tenant == "hooli"          # still inside its grace period
    assert reg.config.tenants["hooli"].keys[0].expires is not None

    assert main(["revoke-key", "hooli", "--hash-prefix", hash_key(first)[:8], *f]) == 0
    assert main(["rotate-key", "hooli", "--revoke-old", *f]) == 0
    third = new_key(capsys.readouterr().out)
    reg = TenantRegistry(tenants_file)
    for old in (first, second):
        with pytest.raises(AuthError, match="revoked"):
            reg.authenticate(old)
    assert reg.authenticate(third).tenant == "hooli"
    assert reg.authenticate("kvh-demo-premium").tenant == "acme"
    assert comments(tenants_file.read_text()) == comments(original)
    assert main(["validate", str(tenants_file)]) == 0
    assert not [p for p in tenants_file.parent.iterdir() if p.name.endswith(".tmp")]


def test_untouched_parts_of_the_file_are_byte_identical(tenants_file, capsys):
    original = tenants_file.read_text()
    assert main(["add", "zeta", "--qos", "batch", "--file", str(tenants_file)]) == 0
    edited = tenants_file.read_text()
    assert edited.startswith(original.rstrip("\n"))
    assert "  zeta:\n    keys:\n      - hash: \"" in edited


@pytest.mark.parametrize("argv,words", [
    (["add", "acme", "--qos", "premium"], "already exists"),
    (["add", "newco", "--qos", "gold"], "unknown QoS class 'gold'"),
    (["add", "newco", "--qos", "batch", "--cache-scope", "team"], "cache_scope 'team'"),
    (["rotate-key", "nobody"], "no tenant 'nobody'"),
    (["rotate-key", "nobody"], "(tenants: acme, globex, initech)"),      # the names it could be
    (["revoke-key", "acme", "--hash-prefix", "ffffffff"], "no key of tenant 'acme'"),
    (["revoke-key", "acme", "--hash-prefix", "9cf"], "at least 4 hex characters"),
])
def test_bad_edits_change_nothing(tenants_file, capsys, argv, words):
    before = tenants_file.read_text()
    assert main([*argv, "--file", str(tenants_file)]) == 1
    assert words in capsys.readouterr().err
    assert tenants_file.read_text() == before


def test_an_edit_of_an_invalid_file_says_where_and_that_nothing_changed(tenants_file, capsys):
    text, line = break_initech_qos(tenants_file)
    assert main(["add", "hooli", "--qos", "batch", "--file", str(tenants_file)]) == 1
    err = capsys.readouterr().err
    assert f"{tenants_file}:{line}: tenants.initech.qos: unknown QoS class 'bulk'" in err
    assert err.rstrip().endswith(f"{tenants_file}: not changed")
    assert tenants_file.read_text() == text


@pytest.mark.parametrize("argv", [["revoke-key", "--hash-prefix", "9cf0"],
                                  ["revoke-key", "acme", "--admin", "--hash-prefix", "9cf0"]])
def test_revoke_needs_a_tenant_or_admin_but_not_both(tenants_file, capsys, argv):
    before = tenants_file.read_text()
    assert main([*argv, "--file", str(tenants_file)]) == 2
    assert "give a tenant NAME, or --admin" in capsys.readouterr().err
    assert tenants_file.read_text() == before


@pytest.mark.parametrize(("argv", "option"), [(["add", "hooli"], "--qos"),
                                               (["revoke-key", "acme"], "--hash-prefix")])
def test_an_edit_without_its_required_option_is_a_usage_error_naming_it(tenants_file, capsys,
                                                                       argv, option):
    before = tenants_file.read_text()
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--file", str(tenants_file)])
    assert exited.value.code == 2
    assert f"the following arguments are required: {option}" in capsys.readouterr().err
    assert tenants_file.read_text() == before


def _with_acme_keys(tenants_file, *entries: str) -> None:
    """Replace acme's demo key with ``entries`` (YAML lines of key mappings)."""
    text = tenants_file.read_text()
    demo = ('      - hash: "9cf0108def0d9414fd22f5bcb7e23806fa423381dad29ce708aa3e1b58db6c43"\n'
            '        label: demo key (public, see README)\n')
    assert demo in text
    tenants_file.write_text(text.replace(demo, "".join(entries)))


def test_a_hash_prefix_must_name_one_key_and_any_case_does(tenants_file, capsys):
    a, b = "abcd" + "0" * 60, "abcd" + "1" * 60
    _with_acme_keys(tenants_file, f'      - hash: "{a}"\n', f'      - hash: "{b}"\n')
    f = ["--file", str(tenants_file)]
    before = tenants_file.read_text()
    assert main(["revoke-key", "acme", "--hash-prefix", "abcd", *f]) == 1
    assert "2 keys of tenant 'acme'" in capsys.readouterr().err
    assert tenants_file.read_text() == before
    assert main(["revoke-key", "acme", "--hash-prefix", "ABCD1", *f]) == 0    # hex in any case
    keys = TenantRegistry(tenants_file).config.tenants["acme"].keys
    assert [k.is_revoked() for k in keys] == [False, True]


def test_rotation_never_extends_an_old_key_nor_touches_a_dead_one(tenants_file, capsys):
    """Old keys get at most the grace period: one that expires sooner keeps its expiry, and
    an expired or revoked key is left as it is (not listed, not revoked again)."""
    soon, dead, gone, live = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)
    _with_acme_keys(tenants_file,
                    f'      - hash: "{soon}"\n        expires: 2030-01-01T01:00:00Z\n',
                    f'      - hash: "{dead}"\n        expires: 2020-01-01T00:00:00Z\n',
                    f'      - hash: "{gone}"\n        revoked: leaked\n',
                    f'      - hash: "{live}"\n')
    from datetime import datetime, timezone

    from kvharbor.tenants.edit import TenantsDocument

    doc = TenantsDocument(tenants_file)
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    _, changes = doc.rotate_key("acme", now=now)                          # 24 h grace
    assert [c[:8] for c in changes] == ["dddddddd"]                      # only the live key
    doc.save()
    keys = {k.hash: k for k in TenantRegistry(tenants_file).config.tenants["acme"].keys}
    assert keys[soon].expires == datetime(2030, 1, 1, 1, tzinfo=timezone.utc)   # not extended
    assert keys[live].expires == datetime(2030, 1, 2, tzinfo=timezone.utc)
    assert keys[dead].expires.year == 2020 and keys[gone].revoked == "leaked"
    _, changes = TenantsDocument(tenants_file).rotate_key("acme", revoke_old=True, now=now)
    ids = {c[:8] for c in changes}              # the live ones, and the key rotated in above
    assert {"aaaaaaaa", "dddddddd"} <= ids and not ids & {"bbbbbbbb", "cccccccc"} and len(ids) == 3


def test_an_unknown_limit_is_refused_by_name(tenants_file):
    from kvharbor.tenants.edit import EditError, TenantsDocument

    with pytest.raises(EditError, match="unknown limit 'rpm'"):
        TenantsDocument(tenants_file).add_tenant("newco", "batch", limits={"rpm": 3})


def test_revoke_admin_key(tenants_file, capsys):
    prefix = hash_key("kvh-demo-admin")[:6]
    assert main(["revoke-key", "--admin", "--hash-prefix", prefix, "--reason", "go live",
                 "--file", str(tenants_file)]) == 0
    assert capsys.readouterr().out == (f"revoked key {hash_key('kvh-demo-admin')[:8]} of admin_keys in "
                                       f"{tenants_file}\n")            # the id `show` lists
    reg = TenantRegistry(tenants_file)
    assert not reg.is_admin("kvh-demo-admin")
    assert reg.config.admin_keys[0].revoked == "go live"


@pytest.mark.parametrize("section", ["", "tenants: {}\n"])
def test_the_first_tenant_of_a_file_without_any(tmp_path, capsys, section):
    path = tmp_path / "tenants.yaml"
    path.write_text("qos_classes:\n  gold: {priority: 1}\n" + section)
    assert main(["add", "acme", "--qos", "gold", "--file", str(path)]) == 0
    key = new_key(capsys.readouterr().out)
    assert TenantRegistry(path).authenticate(key).tenant == "acme"


def test_the_first_admin_key_of_a_file_without_any(tmp_path, capsys):
    path = tmp_path / "tenants.yaml"
    path.write_text("qos_classes:\n  gold: {priority: 1}\ntenants: {}\n")
    assert main(["add-admin-key", "--file", str(path)]) == 0
    key = new_key(capsys.readouterr().out)
    assert TenantRegistry(path).is_admin(key)


def test_keys_are_never_logged(tenants_file, capsys, caplog):
    with caplog.at_level(logging.DEBUG):
        assert main(["add", "hooli", "--qos", "batch", "--file", str(tenants_file)]) == 0
        k1 = new_key(capsys.readouterr().out)
        assert main(["rotate-key", "hooli", "--file", str(tenants_file)]) == 0
        k2 = new_key(capsys.readouterr().out)
        assert main(["add-admin-key", "--file", str(tenants_file)]) == 0
        k3 = new_key(capsys.readouterr().out)
        reg = TenantRegistry(tenants_file)
        reg.authenticate(k2)
        assert reg.is_admin(k3)
    for key in (k1, k2, k3):
        assert key not in caplog.text and key not in tenants_file.read_text()


ACME_USAGE = {"in_flight": 3, "tokens_today": 1234}


class _UsageHandler(BaseHTTPRequestHandler):
    """GET /admin/tenants as the gateway answers it: each tenant's description with its usage
    (``body`` replaces the answer)."""

    body = {"tenants": {"acme": {"qos": "premium", "keys": [], "usage": ACME_USAGE}},
            "status": {"errors": []}}

    def do_GET(self):  # noqa: N802 - http.server API
        ok = self.path == "/admin/tenants" and self.headers.get("Authorization") == \
            "Bearer kvh-demo-admin"
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(self.body).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def usage_server():
    """A stand-in server's base URL; yields (url, handler class) so a test can change ``body``."""
    handler = type("Handler", (_UsageHandler,), {})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", handler
    finally:
        server.shutdown()


def test_show_fetches_usage_with_admin_key(tenants_file, capsys, usage_server):
    url, _ = usage_server
    assert main(["show", "acme", "--file", str(tenants_file), "--json", "--usage-url", url + "/",
                 "--admin-key", "kvh-demo-admin"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["acme"]["usage"] == ACME_USAGE                     # the usage, not the entry
    assert report["acme"]["qos"] == "premium" and report["acme"]["keys"][0]["id"]
    assert main(["show", "--file", str(tenants_file), "--usage-url", url,
                 "--admin-key", "wrong"]) == 1
    assert "401" in capsys.readouterr().err


@pytest.mark.parametrize("body", [["acme"], {"acme": ACME_USAGE}, {"tenants": {"acme": 3}}])
def test_show_says_when_a_server_answers_no_usage(tenants_file, capsys, usage_server, body):
    url, handler = usage_server
    handler.body = body
    assert main(["show", "acme", "--file", str(tenants_file), "--usage-url", url,
                 "--admin-key", "kvh-demo-admin"]) == 1
    assert "answered no tenants' usage (is it a kvharbor server?)" in capsys.readouterr().err


def test_show_needs_an_admin_key_a_reachable_server_and_a_known_tenant(tenants_file, capsys,
                                                                      monkeypatch, usage_server):
    from tests.observability.promql import free_port

    monkeypatch.delenv("KVHARBOR_ADMIN_KEY", raising=False)
    f = ["--file", str(tenants_file)]
    assert main(["show", *f, "--usage-url", usage_server[0]]) == 1
    assert capsys.readouterr().err == "error: --usage-url needs --admin-key (or $KVHARBOR_ADMIN_KEY)\n"
    closed = f"http://127.0.0.1:{free_port()}"          # a port nothing listens on
    assert main(["show", *f, "--usage-url", closed, "--admin-key", "k"]) == 1
    assert f"cannot reach {closed}" in capsys.readouterr().err
    assert main(["show", "nobody", *f]) == 1
    assert "no tenant 'nobody'" in capsys.readouterr().err


def test_show_prints_the_running_apps_usage(kvharbor_app, capsys):
    """Against the app's own /admin/tenants: each tenant's admission counters."""
    from tests.conftest import DEMO

    body = {"model": kvharbor_app.model, "prompt": "hello", "max_tokens": 1}
    with kvharbor_app.client(DEMO["premium"]) as client:                  # acme's key
        assert client.post("/v1/completions", json=body).status_code == 200
    assert main(["show", "acme", "--file", str(kvharbor_app.tenants_path), "--json",
                 "--usage-url", kvharbor_app.base_url, "--admin-key", DEMO["admin"]]) == 0
    usage = json.loads(capsys.readouterr().out)["acme"]["usage"]
    assert usage["tenant"] == "acme" and usage["admitted_total"] >= 1 and "tokens_today" in usage


def test_validate_sums_pinned_blocks_marks_pinned_classes_and_warns_while_a_demo_key_lives(
        tenants_file, capsys):
    from kvharbor.tenants.edit import TenantsDocument
    from kvharbor.tenants.keys import DEMO_KEYS

    assert main(["validate", str(tenants_file)]) == 0
    out = capsys.readouterr().out
    config = TenantRegistry(tenants_file).config
    pinned = sum(t.pinned_kv_blocks for t in config.tenants.values())
    assert pinned > 0 and f"pinned_kv_blocks total: {pinned}" in out
    assert "premium (priority 100, pinned)" in out and "standard (priority 50)," in out
    assert "WARNING: public demo keys" in out

    doc = TenantsDocument(tenants_file)                  # every tenant's demo key revoked...
    for name, tenant in config.tenants.items():
        for entry in tenant.keys:
            if entry.hash in DEMO_KEYS.values():
                doc.revoke_key(name, entry.hash[:8], "test")
    doc.save()
    assert main(["validate", str(tenants_file)]) == 0
    assert "WARNING: public demo keys" in capsys.readouterr().out     # ...the admin's lives
    assert main(["revoke-key", "--admin", "--hash-prefix", hash_key("kvh-demo-admin")[:8],
                 "--file", str(tenants_file)]) == 0
    assert main(["validate", str(tenants_file)]) == 0
    assert "WARNING" not in capsys.readouterr().out


def test_add_passes_every_option_and_omitted_limits_stay_inherited(tenants_file, capsys):
    f = ["--file", str(tenants_file)]
    assert main(["add", "hooli", "--qos", "batch", "--allowed-model", "m1", "--allowed-model", "m2",
                 "--label", "ci", "--max-tokens-per-request", "9", *f]) == 0
    assert main(["add-admin-key", "--label", "ops", *f]) == 0
    config = TenantRegistry(tenants_file).config
    hooli = config.tenants["hooli"]
    assert (hooli.allowed_models, hooli.keys[0].label) == (["m1", "m2"], "ci")
    assert config.admin_keys[-1].label == "ops"
    assert hooli.model_fields_set.isdisjoint({"requests_per_minute", "daily_token_budget"})
    limits, defaults = config.limits_for("hooli"), config.defaults
    assert limits.max_tokens_per_request == 9
    assert (limits.requests_per_minute, limits.daily_token_budget) == \
        (defaults.requests_per_minute, defaults.daily_token_budget)


def test_rotate_keeps_old_keys_for_the_grace_period_given(tenants_file, capsys):
    from datetime import datetime, timedelta, timezone

    before = datetime.now(timezone.utc).replace(microsecond=0)         # the file keeps seconds
    assert main(["rotate-key", "acme", "--grace-hours", "2", "--file", str(tenants_file)]) == 0
    expires = TenantRegistry(tenants_file).config.tenants["acme"].keys[0].expires
    assert before + timedelta(hours=2) <= expires <= datetime.now(timezone.utc) + timedelta(hours=2)


def test_show_prints_each_tenant_and_its_fields_or_says_why_the_file_is_invalid(tenants_file,
                                                                                capsys):
    assert main(["show", "acme", "--file", str(tenants_file)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "acme:" and '  qos: "premium"' in out
    _, line = break_initech_qos(tenants_file)
    assert main(["show", "--file", str(tenants_file)]) == 1
    captured = capsys.readouterr()
    assert f"{tenants_file}:{line}: tenants.initech.qos: unknown QoS class 'bulk'" in captured.err
    assert captured.out == "" and "Traceback" not in captured.err


def test_the_module_runs_standalone(tenants_file):
    """``python -m kvharbor.tenants.cli`` (the module docstring's form) runs a command and
    exits with its code."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "kvharbor.tenants.cli", "validate", str(tenants_file)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and f"{tenants_file}: OK" in ok.stdout
    break_initech_qos(tenants_file)
    bad = subprocess.run([sys.executable, "-m", "kvharbor.tenants.cli", "validate", str(tenants_file)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID" in bad.stderr


def test_editing_a_missing_file_is_an_error_not_a_traceback(tmp_path, capsys):
    assert main(["add", "hooli", "--qos", "batch", "--file", str(tmp_path / "none.yaml")]) == 1
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("stdin, code, out", [
    ("kvh-secret\n", 0, hash_key("kvh-secret")), ("  kvh-secret  \n", 0, hash_key("kvh-secret")),
    ("Kvh-Secret", 0, hash_key("Kvh-Secret")), ("\n", 1, "")])
def test_hash_key_reads_one_key_from_stdin(monkeypatch, capsys, stdin, code, out):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(["hash-key"]) == code
    captured = capsys.readouterr()
    assert captured.out.strip() == out
    assert ("pipe the key on stdin" in captured.err) == (code == 1)
