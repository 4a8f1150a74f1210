"""Comment-preserving edits of ``tenants.yaml`` (what the ``kvharbor tenants`` CLI does).

A :class:`TenantsDocument` holds the file as a ruamel.yaml round-trip tree, so comments, key
order and quoting survive an edit. ``save`` validates the edited text with the same loader the
server uses and refuses to write an invalid file; the write is atomic (temp file in the same
directory, fsync, ``os.replace``), so a server polling the file never sees half of it.

Edits that create a key return the plaintext key to the caller (to print once); only its hash
enters the document.
"""

from __future__ import annotations

import io
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.scalarstring import DoubleQuotedScalarString

from kvharbor.tenants.keys import generate_key, hash_key, hash_prefix
from kvharbor.tenants.loader import parse_tenants_text, round_trip_yaml
from kvharbor.tenants.schema import LIMIT_FIELDS, ApiKeyEntry, TenantsFile


class EditError(ValueError):
    """An edit that cannot be applied; the message says what to change."""


@dataclass(slots=True, frozen=True)
class NewKey:
    """A freshly issued key: ``key`` is shown once and never stored."""

    key: str
    key_id: str          # 8-char hash prefix


def _utc(ts: datetime) -> datetime:
    """Whole seconds in UTC: written as a plain YAML timestamp, e.g. 2026-11-23 09:47:30+00:00."""
    return ts.astimezone(timezone.utc).replace(microsecond=0)


def _iso(ts: datetime) -> str:
    return _utc(ts).isoformat().replace("+00:00", "Z")


def _key_entry(label: str | None, now: datetime) -> tuple[CommentedMap, NewKey]:
    key = generate_key()
    digest = hash_key(key)
    entry = CommentedMap()
    entry["hash"] = DoubleQuotedScalarString(digest)
    if label:
        entry["label"] = label
    entry["created"] = _utc(now)
    return entry, NewKey(key, hash_prefix(digest))


class TenantsDocument:
    """A tenants file loaded for editing."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._yaml = round_trip_yaml()
        text = self.path.read_text(encoding="utf-8")
        parse_tenants_text(text, str(self.path))    # refuse to edit a file that is invalid
        self.doc = self._yaml.load(text)

    def text(self) -> str:
        """The document as YAML text (comments included)."""
        buf = io.StringIO()
        self._yaml.dump(self.doc, buf)
        return buf.getvalue()

    def validate(self) -> TenantsFile:
        """Validate the edited text; raises ``TenantsFileError`` listing every problem."""
        return parse_tenants_text(self.text(), str(self.path))

    def save(self) -> TenantsFile:
        """Validate, then atomically replace the file. Nothing is written if invalid."""
        config = self.validate()
        atomic_write(self.path, self.text())
        return config

    # ---- edits -----------------------------------------------------------------------------
    def add_tenant(self, name: str, qos: str, *, cache_scope: str | None = None,
                   allowed_models: list[str] | None = None, limits: dict | None = None,
                   label: str | None = None, now: datetime | None = None) -> NewKey:
        """Append tenant ``name`` with one new key; returns that key."""
        tenants = self.doc.get("tenants")
        if not isinstance(tenants, CommentedMap) or not tenants:
            tenants = self.doc["tenants"] = CommentedMap()
        if name in tenants:
            raise EditError(f"tenant {name!r} already exists; use rotate-key to give it a new key")
        entry, new_key = _key_entry(label, now or datetime.now(timezone.utc))
        tenant = CommentedMap()
        tenant["keys"] = CommentedSeq([entry])
        tenant["qos"] = qos
        if cache_scope:
            tenant["cache_scope"] = cache_scope
        if (cache_scope or "private") == "private":
            tenant["cache_secret"] = new_cache_secret()
        elif cache_scope.startswith("shared:") and not any(
                isinstance(t, dict) and t.get("cache_scope") == cache_scope for t in tenants.values()):
            self.ensure_cache_scope(cache_scope.removeprefix("shared:"))   # a new group: new secret
        if allowed_models:
            tenant["allowed_models"] = CommentedSeq(allowed_models)
        for field, value in (limits or {}).items():
            if field not in LIMIT_FIELDS:
                raise EditError(f"unknown limit {field!r}; known: {', '.join(LIMIT_FIELDS)}")
            tenant[field] = value
        tenants[name] = tenant
        return new_key

    def ensure_cache_scope(self, group: str) -> bool:
        """Give shared scope ``group`` a random secret in ``cache_scopes`` unless it has one.
        Returns True when one was created."""
        scopes = self.doc.get("cache_scopes")
        if not isinstance(scopes, CommentedMap):
            scopes = self.doc["cache_scopes"] = CommentedMap()
        if isinstance(scopes.get(group), dict) and scopes[group].get("secret"):
            return False
        scopes[group] = CommentedMap(secret=new_cache_secret())
        return True

    def rotate_key(self, name: str, *, grace: timedelta = timedelta(hours=24),
                   revoke_old: bool = False, label: str | None = None,
                   now: datetime | None = None) -> tuple[NewKey, list[str]]:
        """Add a new key; old usable keys expire after ``grace`` or are revoked now.

        Returns:
            the new key and one line per old key saying what happened to it.
        """
        now = now or datetime.now(timezone.utc)
        keys = self._keys(name)
        changes = []
        for i in range(len(keys)):
            raw = _as_mapping(keys, i)
            entry = ApiKeyEntry.model_validate(raw)
            if entry.is_revoked() or entry.is_expired(now.timestamp()):
                continue
            if revoke_old:
                raw["revoked"] = f"rotated {_iso(now)}"
                changes.append(f"{hash_prefix(entry.hash)}: revoked")
            elif entry.expires is None or entry.expires > now + grace:
                raw["expires"] = _utc(now + grace)
                changes.append(f"{hash_prefix(entry.hash)}: expires {_iso(now + grace)}")
        entry, new_key = _key_entry(label, now)
        keys.append(entry)
        return new_key, changes

    def revoke_key(self, name: str | None, prefix: str, reason: str | None = None) -> str:
        """Revoke the one key of tenant ``name`` (None: an admin key) whose hash starts with
        ``prefix``; returns its 8-char id."""
        prefix = prefix.strip().lower()
        if len(prefix) < 4:
            raise EditError("--hash-prefix needs at least 4 hex characters")
        keys = self._keys(name) if name is not None else self._admin_keys()
        matches = [(i, raw) for i, raw in enumerate(keys)
                   if ApiKeyEntry.model_validate(raw).hash.startswith(prefix)]
        owner = f"tenant {name!r}" if name is not None else "admin_keys"
        if len(matches) != 1:
            found = "no key" if not matches else f"{len(matches)} keys"
            raise EditError(f"{found} of {owner} has a hash starting with {prefix!r}; "
                            "`kvharbor tenants show` lists key ids")
        raw = _as_mapping(keys, matches[0][0])
        raw["revoked"] = reason or True
        return hash_prefix(raw["hash"])

    def add_admin_key(self, label: str | None = None, now: datetime | None = None) -> NewKey:
        """Append a new admin key; returns it."""
        entry, new_key = _key_entry(label, now or datetime.now(timezone.utc))
        self._admin_keys().append(entry)
        return new_key

    def _keys(self, name: str) -> CommentedSeq:
        tenants = self.doc.get("tenants") or {}
        if name not in tenants:
            known = ", ".join(tenants) or "none"
            raise EditError(f"no tenant {name!r} in {self.path} (tenants: {known})")
        tenant = tenants[name]
        if not isinstance(tenant.get("keys"), CommentedSeq):
            tenant["keys"] = CommentedSeq()
        return tenant["keys"]

    def _admin_keys(self) -> CommentedSeq:
        if not isinstance(self.doc.get("admin_keys"), CommentedSeq):
            self.doc["admin_keys"] = CommentedSeq()
        return self.doc["admin_keys"]


def _as_mapping(keys: CommentedSeq, i: int) -> CommentedMap:
    """``keys[i]`` as a mapping; a bare digest string becomes ``{hash: ...}`` in place."""
    if isinstance(keys[i], str):
        keys[i] = CommentedMap([("hash", DoubleQuotedScalarString(keys[i]))])
    return keys[i]


def new_cache_secret() -> str:
    """A random cache-scope salt: 128 bits, hex."""
    return secrets.token_hex(16)


def atomic_write(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, keeping the file's permission bits."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
