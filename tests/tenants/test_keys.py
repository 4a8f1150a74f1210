"""API keys: format, hashing, constant-time match, demo keys."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from kvharbor.tenants.keys import (DEMO_KEYS, generate_key, hash_key, hash_prefix, key_matches,
                                   looks_like_key_hash)
from kvharbor.tenants.registry import TenantRegistry


def test_generated_keys_are_prefixed_random_and_long():
    keys = {generate_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(k.startswith("kvh-") and len(k) >= 40 for k in keys)


def test_hash_is_sha256_hex_and_matches_only_its_key():
    key = generate_key()
    digest = hash_key(key)
    assert digest == hashlib.sha256(key.encode()).hexdigest() and looks_like_key_hash(digest)
    assert key_matches(key, digest) and key_matches(key, digest.upper())
    assert not key_matches(key + "x", digest)
    assert not looks_like_key_hash(key)
    for near in (digest.upper(), digest + "0", "0" + digest, digest[:-1], digest + "\n"):
        assert not looks_like_key_hash(near), near
    assert hash_prefix(digest) == digest[:8]


ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [ROOT / "tenants.yaml", ROOT / "kvharbor" / "data" / "tenants.yaml"]
README_ROW = re.compile(r"^\| `(kvh-demo-\w+)` \| (\S+) \| (\w+)", re.MULTILINE)


def _readme_demo_keys() -> dict[str, tuple[str, str]]:
    """The README's demo-key table: key -> (tenant, QoS class); '—' for the admin key."""
    return {key: (tenant, qos) for key, tenant, qos in README_ROW.findall((ROOT / "README.md").read_text())}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_readme_demo_keys_open_the_example_tenants_they_name(example):
    """Each key of the README's table authenticates, in both example files, as the tenant and
    class the table names (the admin key opens /admin only), and no file stores a key in clear."""
    table = _readme_demo_keys()
    assert set(table) == set(DEMO_KEYS), table
    registry = TenantRegistry(example)
    for key, (tenant, qos) in table.items():
        if tenant == "—":
            assert registry.is_admin(key), key
            continue
        principal = registry.authenticate(key)
        assert (principal.tenant, principal.qos_name) == (tenant, qos), key
    text = example.read_text()
    assert not [k for k in table if k in text], "a demo key is stored in clear"
    assert registry.active_demo_keys(), "the example file must report its demo keys as active"
