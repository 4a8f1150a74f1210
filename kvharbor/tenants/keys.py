"""API keys: generation, hashing and comparison.

Invariants:
    * A plaintext key exists only in the client's hands and, once, on the terminal of the
      admin who created it. ``tenants.yaml`` and every log line hold at most its SHA-256 hex
      digest (or a short prefix of that digest, see :func:`hash_prefix`).
    * Keys look like ``kvh-<43 url-safe chars>`` (256 bits of entropy), so a plain SHA-256 is
      enough: there is nothing to brute-force, and a salt or slow hash would buy nothing.
    * Comparisons of secrets go through :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import NewType

KeyHash = NewType("KeyHash", str)
"""Lowercase SHA-256 hex digest (64 chars) of an API key."""

KEY_PREFIX = "kvh-"
KEY_HASH_RE = re.compile(r"[0-9a-f]{64}")   # fullmatch: `$` would let a trailing newline by
_LOG_PREFIX_CHARS = 8


def generate_key() -> str:
    """Return a new random API key, ``kvh-`` followed by 43 url-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(api_key: str) -> KeyHash:
    """SHA-256 hex digest of ``api_key`` (UTF-8); what ``tenants.yaml`` stores."""
    return KeyHash(hashlib.sha256(api_key.encode("utf-8")).hexdigest())


def key_matches(api_key: str, key_hash: str) -> bool:
    """Constant-time check that ``api_key`` hashes to ``key_hash``."""
    return hmac.compare_digest(hash_key(api_key), key_hash.lower())


def hash_prefix(key_hash: str) -> str:
    """The first 8 hex chars of a key hash: safe to log, print, and pass to ``revoke-key``."""
    return key_hash[:_LOG_PREFIX_CHARS]


def looks_like_key_hash(text: str) -> bool:
    """True if ``text`` is a lowercase 64-char hex digest (not a plaintext key)."""
    return bool(KEY_HASH_RE.fullmatch(text))


DEMO_KEYS: dict[str, KeyHash] = {
    key: hash_key(key)
    for key in ("kvh-demo-premium", "kvh-demo-standard", "kvh-demo-batch", "kvh-demo-admin")
}
"""Plaintext demo keys of the example ``tenants.yaml`` -> their hashes.

They are public (printed in the README), so a server that still accepts any of them must warn;
see :meth:`kvharbor.tenants.registry.TenantRegistry.active_demo_keys`.
"""

DEMO_KEY_HASHES: frozenset[KeyHash] = frozenset(DEMO_KEYS.values())
