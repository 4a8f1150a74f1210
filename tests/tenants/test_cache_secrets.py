"""Cache scopes are salted with a random secret from tenants.yaml, not the tenant's name."""

from __future__ import annotations

import re

from kvharbor import LLM, SamplingParams
from kvharbor.tenants import TenantRegistry
from kvharbor.tenants.cli import main
from kvharbor.tenants.edit import TenantsDocument
from kvharbor.tenants.registry import describe_tenant

KEY_RE = re.compile(r"API key \(shown once; store it now\): (kvh-\S+)")
SECRET = re.compile(r"^[0-9a-f]{32}$")


def _add(tenants_file, capsys, name, *extra) -> str:
    assert main(["add", name, "--qos", "standard", "--file", str(tenants_file), *extra]) == 0
    return KEY_RE.findall(capsys.readouterr().out)[0]


def _remove(tenants_file, name) -> None:
    doc = TenantsDocument(tenants_file)
    del doc.doc["tenants"][name]
    doc.save()


def test_a_recreated_tenant_gets_a_new_salt_and_a_cold_cache(tenants_file, capsys):
    key = _add(tenants_file, capsys, "newco")
    secret = TenantRegistry(tenants_file).config.tenants["newco"].cache_secret
    assert SECRET.match(secret) and secret not in capsys.readouterr().out
    old_salt = TenantRegistry(tenants_file).authenticate(key).cache_salt
    assert old_salt == f"tenant:newco:{secret}"
    _remove(tenants_file, "newco")
    new_key = _add(tenants_file, capsys, "newco")
    new_salt = TenantRegistry(tenants_file).authenticate(new_key).cache_salt
    assert new_salt.startswith("tenant:newco:") and new_salt != old_salt

    llm = LLM(device="cpu", num_kv_blocks=32)
    prompt = [(5 * i) % 251 for i in range(80)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt], params, tenant="newco", cache_salt=old_salt)
    assert llm.generate([prompt], params, tenant="newco", cache_salt=old_salt)[0].num_cached_tokens == 64
    assert llm.generate([prompt], params, tenant="newco", cache_salt=new_salt)[0].num_cached_tokens == 0


def test_a_new_shared_group_gets_one_secret_its_members_share(tenants_file, capsys):
    a = _add(tenants_file, capsys, "a-co", "--cache-scope", "shared:labs")
    b = _add(tenants_file, capsys, "b-co", "--cache-scope", "shared:labs")
    reg = TenantRegistry(tenants_file)
    secret = reg.config.cache_scopes["labs"].secret
    assert SECRET.match(secret)
    assert reg.authenticate(a).cache_salt == reg.authenticate(b).cache_salt == f"group:labs:{secret}"
    shown = describe_tenant(reg.config, "a-co")["cache_salt"]
    assert secret not in shown and shown.startswith("group:labs#")


def test_files_without_secrets_keep_the_name_salt(tenants_file, capsys):
    """The example file predates secrets: its scopes keep their old salts, and adding a member
    to an existing group does not change that group's salt under its other members."""
    before = TenantRegistry(tenants_file)
    private = [n for n, t in before.config.tenants.items() if t.cache_scope == "private"][0]
    assert before.cache_salt(private) == f"tenant:{private}"
    key = _add(tenants_file, capsys, "hooli", "--cache-scope", "shared:partners")
    after = TenantRegistry(tenants_file)
    assert "partners" not in after.config.cache_scopes
    assert after.authenticate(key).cache_salt == "group:partners"
