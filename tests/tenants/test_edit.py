"""``TenantsDocument`` edits (what ``kvharbor tenants`` writes), read back through the loader
the server uses: new key entries, cache secrets, rotation of keys in any form, and a write that
keeps the file's mode and leaves nothing behind when it fails."""

from __future__ import annotations

import os
import stat
from datetime import datetime, timedelta, timezone

import pytest
from ruamel.yaml.comments import CommentedMap

from kvharbor.tenants import TenantRegistry, TenantsFileError
from kvharbor.tenants.edit import TenantsDocument
from kvharbor.tenants.keys import hash_key

NOW = datetime(2030, 1, 1, 12, 30, 15, 123456, tzinfo=timezone(timedelta(hours=2)))
UTC_NOW = datetime(2030, 1, 1, 10, 30, 15, tzinfo=timezone.utc)     # NOW in whole UTC seconds


def tenants(path):
    return TenantRegistry(path).config.tenants


def test_a_new_tenants_key_entry_has_its_label_and_a_whole_second_utc_time(tenants_file):
    doc = TenantsDocument(tenants_file)
    new = doc.add_tenant("newco", "batch", allowed_models=["kvharbor-tiny"], label="ci", now=NOW)
    doc.save()
    newco = tenants(tenants_file)["newco"]
    [key] = newco.keys
    assert key.hash == hash_key(new.key) and new.key_id == key.hash[:8]
    assert (key.label, key.created) == ("ci", UTC_NOW)
    assert "123456" not in tenants_file.read_text()
    assert newco.allowed_models == ["kvharbor-tiny"]


def test_a_private_tenant_gets_a_secret_whether_or_not_private_is_named(tenants_file):
    doc = TenantsDocument(tenants_file)
    doc.add_tenant("implicit", "batch")
    doc.add_tenant("explicit", "batch", cache_scope="private")
    doc.save()
    secrets = [tenants(tenants_file)[name].cache_secret for name in ("implicit", "explicit")]
    assert all(s and len(s) == 32 for s in secrets) and secrets[0] != secrets[1]


def test_a_groups_secret_is_kept_when_its_first_member_is_added(tenants_file):
    """An admin may write a group's secret before any tenant uses the group: adding the first
    member keeps it (a new secret would split the group's cache from what it was meant to be)."""
    doc = TenantsDocument(tenants_file)
    doc.doc["cache_scopes"] = CommentedMap(labs=CommentedMap(secret="ab" * 16))
    doc.add_tenant("first", "batch", cache_scope="shared:labs")
    doc.save()
    assert TenantRegistry(tenants_file).config.cache_scopes["labs"].secret == "ab" * 16
    doc = TenantsDocument(tenants_file)
    assert doc.ensure_cache_scope("labs") is False
    doc.doc["cache_scopes"]["other"] = CommentedMap()             # named without a secret
    assert doc.ensure_cache_scope("other") is True and len(doc.doc["cache_scopes"]["other"]["secret"]) == 32


def test_rotation_cuts_a_later_expiry_to_the_grace_and_says_when_in_utc(tenants_file):
    doc = TenantsDocument(tenants_file)
    keys = doc.doc["tenants"]["acme"]["keys"]
    keys[0]["expires"] = datetime(2031, 1, 1, tzinfo=timezone.utc)       # later than the grace
    new, changes = doc.rotate_key("acme", grace=timedelta(hours=1), now=NOW)
    doc.save()
    assert changes == [f"{keys[0]['hash'][:8]}: expires 2030-01-01T11:30:15Z"]
    expiries = {k.hash: k.expires for k in tenants(tenants_file)["acme"].keys}
    assert expiries[keys[0]["hash"]] == UTC_NOW + timedelta(hours=1)
    assert expiries[hash_key(new.key)] is None


def test_rotation_revokes_a_key_written_as_a_bare_hash_and_says_when(tenants_file):
    bare = "e" * 64
    doc = TenantsDocument(tenants_file)
    doc.doc["tenants"]["acme"]["keys"].append(bare)
    doc.save()
    doc = TenantsDocument(tenants_file)
    _, changes = doc.rotate_key("acme", revoke_old=True, now=NOW)
    doc.save()
    assert f"{bare[:8]}: revoked" in changes
    revoked = {k.hash: k.revoked for k in tenants(tenants_file)["acme"].keys}
    assert revoked[bare] == "rotated 2030-01-01T10:30:15Z"


def test_a_tenant_without_a_keys_field_gets_one_on_rotation(tenants_file):
    doc = TenantsDocument(tenants_file)
    del doc.doc["tenants"]["acme"]["keys"]
    new, changes = doc.rotate_key("acme", now=NOW)
    doc.save()
    assert changes == [] and [k.hash for k in tenants(tenants_file)["acme"].keys] == [hash_key(new.key)]


def test_an_invalid_file_is_refused_before_any_edit(tenants_file):
    tenants_file.write_text(tenants_file.read_text().replace("qos: batch", "qos: bulk"))
    with pytest.raises(TenantsFileError, match="unknown QoS class 'bulk'"):
        TenantsDocument(tenants_file)


def test_a_save_keeps_the_files_mode_and_a_failed_one_leaves_it_whole(tenants_file, monkeypatch):
    os.chmod(tenants_file, 0o640)
    doc = TenantsDocument(tenants_file)
    doc.add_tenant("newco", "batch")
    doc.save()
    assert stat.S_IMODE(tenants_file.stat().st_mode) == 0o640
    before = tenants_file.read_text()
    doc.add_tenant("other", "batch")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        doc.save()
    assert tenants_file.read_text() == before
    assert sorted(p.name for p in tenants_file.parent.iterdir()) == [tenants_file.name]
