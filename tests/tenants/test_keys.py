"""API keys: format, hashing, constant-time match, demo keys."""

from __future__ import annotations

import hashlib

from kvharbor.tenants.keys import (DEMO_KEYS, generate_key, hash_key, hash_prefix, key_matches,
                                   looks_like_key_hash)


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
    assert hash_prefix(digest) == digest[:8]


def test_demo_keys_are_the_documented_ones():
    assert set(DEMO_KEYS) == {"kvh-demo-premium", "kvh-demo-standard", "kvh-demo-batch",
                              "kvh-demo-admin"}
    assert all(hash_key(k) == h for k, h in DEMO_KEYS.items())
