"""TenantRegistry: the live tenants configuration, API-key lookup, and hot reload.

Plain, thread-safe class (no Ray). Each gateway replica holds its own registry over the same
file; ``reload_if_changed`` is cheap (one ``stat`` when nothing changed), so a replica can call
it every second or two (``watch`` does that in an asyncio task).

Invariants:
    * The active configuration is always one that validated completely. An invalid edit is
      logged and recorded in ``status()``; the previous configuration stays in force.
    * ``version`` starts at 1 and grows by one per successful (re)load with new content.
    * Lookups go through an index keyed by the SHA-256 of the presented key, so a lookup is
      O(1) and its timing depends only on a digest the caller cannot steer; the final match is
      confirmed with :func:`hmac.compare_digest`.
    * No method logs or stores a plaintext key; logs carry at most an 8-char hash prefix.

All methods are fast and never do blocking I/O except ``reload_if_changed``/``__init__``
(one small file read), so they can be called directly from an async FastAPI handler.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvharbor.tenants.errors import AuthError, ForbiddenError
from kvharbor.tenants.keys import DEMO_KEY_HASHES, hash_key, hash_prefix
from kvharbor.tenants.loader import ConfigIssue, TenantsFileError, parse_tenants_text
from kvharbor.tenants.schema import (ApiKeyEntry, QoSClassConfig, TenantConfig, TenantId,
                                     TenantLimits, TenantsFile)

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Principal:
    """Who is calling: the result of a successful :meth:`TenantRegistry.authenticate`."""

    tenant: TenantId
    config: TenantConfig
    qos_name: str
    qos: QoSClassConfig
    limits: TenantLimits
    cache_salt: str | None          # None = public scope
    key_id: str                     # 8-char hash prefix: safe for logs and metrics
    config_version: int


def cache_salt_for(cfg: TenantConfig, tenant: str, scopes: dict | None = None) -> str | None:
    """The block-hash salt of ``tenant``'s cache scope.

    private -> ``tenant:<name>:<cache_secret>``; shared:<g> -> ``group:<g>:<secret>`` (the
    secret from ``cache_scopes[g]`` of the file, ``scopes``); public -> None. Without a
    secret (files written before secrets existed) the name alone: ``tenant:<name>`` /
    ``group:<g>``; such a scope is inherited by a re-created tenant of the same name.
    """
    scope = cfg.cache_scope
    if scope == "public":
        return None
    if scope.startswith("shared:"):
        group = scope.removeprefix("shared:")
        entry = (scopes or {}).get(group)
        return f"group:{group}:{entry.secret}" if entry is not None else f"group:{group}"
    return f"tenant:{tenant}:{cfg.cache_secret}" if cfg.cache_secret else f"tenant:{tenant}"


def scope_id(salt: str | None) -> str:
    """A printable id of a cache scope's salt that does not reveal its secret."""
    if salt is None:
        return "public"
    name, _, secret = salt.partition(":")[2].partition(":")
    digest = hashlib.sha256(secret.encode()).hexdigest()[:8] if secret else ""
    return f"{salt.split(':')[0]}:{name}" + (f"#{digest}" if secret else "")


def _printable_salt(t: TenantConfig, name: str, config: TenantsFile) -> str | None:
    salt = cache_salt_for(t, name, config.cache_scopes)
    return None if salt is None else scope_id(salt)


def describe_tenant(config: TenantsFile, name: str) -> dict:
    """JSON-safe summary of tenant ``name``: class, scope, effective limits, key ids/status."""
    t = config.tenants[name]
    keys = [{"id": hash_prefix(e.hash), "label": e.label,
             "expires": e.expires.isoformat() if e.expires else None,
             "revoked": e.revoked or False} for e in t.keys]
    return {"qos": t.qos, "priority": config.qos_classes[t.qos].priority,
            "cache_scope": t.cache_scope, "cache_salt": _printable_salt(t, name, config),
            "allowed_models": t.allowed_models or "all",
            "limits": config.limits_for(name).as_dict(), "pinned_kv_blocks": t.pinned_kv_blocks,
            "pinned_prefixes": len(t.pinned_prefixes), "keys": keys}


@dataclass(slots=True, frozen=True)
class _Snapshot:
    """One validated configuration plus its key index; replaced whole on reload."""

    config: TenantsFile
    version: int
    key_index: dict[str, tuple[TenantId, ApiKeyEntry]]
    admin_index: dict[str, ApiKeyEntry]

    @classmethod
    def build(cls, config: TenantsFile, version: int) -> _Snapshot:
        index = {e.hash: (TenantId(name), e) for name, t in config.tenants.items() for e in t.keys}
        return cls(config, version, index, {e.hash: e for e in config.admin_keys})


class TenantRegistry:
    """Loads ``tenants.yaml``, authenticates keys, and reloads the file when it changes."""

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time):
        """Load ``path``; raises :class:`TenantsFileError` if the first load is invalid.

        Args:
            path: the tenants file.
            clock: Unix-seconds clock used for key expiry (injectable for tests).
        """
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._listeners: list[Callable[[TenantsFile, int], None]] = []
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._stat_sig: tuple[int, int] | None = None
        self._content_hash = ""
        self._rejected_hash = ""
        try:
            text = self._read()
        except OSError as exc:
            raise TenantsFileError(str(self.path), [ConfigIssue(
                str(self.path), None, "", f"cannot read: {exc.strerror}")]) from None
        self._snap = _Snapshot.build(parse_tenants_text(text, str(self.path)), 1)
        self._content_hash = hashlib.sha256(text.encode()).hexdigest()
        self._loaded_at = clock()

    # ---- read side -------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Increments by one on each successful load of new content (first load: 1)."""
        return self._snap.version

    @property
    def config(self) -> TenantsFile:
        """The active, validated configuration (do not mutate)."""
        return self._snap.config

    def authenticate(self, api_key: str | None) -> Principal:
        """Map an API key to its tenant. Raises :class:`AuthError` (401) if it is not usable."""
        if not api_key:
            raise AuthError("missing API key: send the header `Authorization: Bearer <key>`")
        snap = self._snap
        digest = hash_key(api_key)
        found = snap.key_index.get(digest)
        if found is None or not hmac.compare_digest(found[1].hash, digest):
            raise AuthError("invalid API key")
        tenant, entry = found
        self._check_entry(entry, "API key")
        cfg = snap.config.tenants[tenant]
        return Principal(tenant=tenant, config=cfg, qos_name=cfg.qos,
                         qos=snap.config.qos_classes[cfg.qos], limits=snap.config.limits_for(tenant),
                         cache_salt=cache_salt_for(cfg, tenant, snap.config.cache_scopes),
                         key_id=hash_prefix(digest),
                         config_version=snap.version)

    def is_admin(self, api_key: str | None) -> bool:
        """True if ``api_key`` is a current (unexpired, unrevoked) admin key."""
        if not api_key:
            return False
        digest = hash_key(api_key)
        entry = self._snap.admin_index.get(digest)
        if entry is None or not hmac.compare_digest(entry.hash, digest):
            return False
        return not entry.is_revoked() and not entry.is_expired(self._clock())

    def check_model(self, principal: Principal, model: str) -> None:
        """Raise :class:`ForbiddenError` (403) if the tenant may not use ``model``."""
        allowed = principal.config.allowed_models
        if allowed and model not in allowed:
            raise ForbiddenError(f"tenant {principal.tenant!r} may not use model {model!r}; "
                                 f"allowed: {', '.join(allowed)}", code="model_not_allowed")

    def cache_salt(self, tenant: str) -> str | None:
        """Cache-scope salt for block hashes: ``tenant:<name>``, ``group:<g>`` or None."""
        config = self._snap.config
        return cache_salt_for(config.tenants[tenant], tenant, config.cache_scopes)

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters of the file: name -> checkpoint directory (relative paths read
        from the file's directory)."""
        return self._snap.config.lora_adapter_paths(self.path.parent)

    def pinned_kv_blocks_total(self) -> int:
        """Sum of ``pinned_kv_blocks`` over all tenants: the pinned region's target size."""
        return sum(t.pinned_kv_blocks for t in self._snap.config.tenants.values())

    def pinned_prefixes(self) -> dict[TenantId, list[str]]:
        """Tenant -> its pinned system prompts (tenants without any are left out)."""
        return {TenantId(n): list(t.pinned_prefixes)
                for n, t in self._snap.config.tenants.items() if t.pinned_prefixes}

    def describe(self, tenant: str | None = None) -> dict[str, dict]:
        """JSON-safe view of one or all tenants for admin pages (keys shown by 8-char id)."""
        config = self._snap.config
        names = [tenant] if tenant is not None else list(config.tenants)
        return {name: describe_tenant(config, name) for name in names}

    def active_demo_keys(self) -> list[str]:
        """Where a public demo key is still accepted: ``tenant`` names and/or ``"admin"``."""
        snap, now = self._snap, self._clock()
        usable = [(h, owner[0]) for h, owner in snap.key_index.items()
                  if not owner[1].is_revoked() and not owner[1].is_expired(now)]
        usable += [(h, "admin") for h, e in snap.admin_index.items()
                   if not e.is_revoked() and not e.is_expired(now)]
        return sorted({owner for h, owner in usable if h in DEMO_KEY_HASHES})

    @property
    def sha256(self) -> str:
        """SHA-256 (hex) of the file text the active configuration came from. Unlike
        ``version`` (this process's count of reloads) it is the same in every process that
        applied the same file: compare it with ``sha256sum tenants.yaml``."""
        return self._content_hash

    def status(self) -> dict:
        """``{"path", "version", "sha256", "loaded_at", "last_error", "last_error_at"}``
        (times: Unix s)."""
        with self._lock:
            return {"path": str(self.path), "version": self._snap.version, "sha256": self._content_hash,
                    "loaded_at": self._loaded_at, "last_error": self._last_error,
                    "last_error_at": self._last_error_at}

    def _check_entry(self, entry: ApiKeyEntry, what: str) -> None:
        if entry.is_revoked():
            raise AuthError(f"{what} has been revoked; ask your administrator for a new key",
                            code="revoked_api_key")
        if entry.is_expired(self._clock()):
            raise AuthError(f"{what} expired at {entry.expires.isoformat()}; ask your "
                            "administrator to rotate it", code="expired_api_key")

    # ---- reload ----------------------------------------------------------------------------
    def add_listener(self, fn: Callable[[TenantsFile, int], None]) -> None:
        """Call ``fn(config, version)`` after each successful reload (not the first load)."""
        self._listeners.append(fn)

    def reload_if_changed(self) -> bool:
        """Reload if the file changed; True if a new configuration became active.

        A change is detected by (mtime_ns, size), then confirmed by content hash. An invalid
        file is logged once per distinct content and recorded in ``status()``; the previous
        configuration stays active and False is returned.
        """
        with self._lock:
            try:
                st = self.path.stat()
            except OSError as exc:
                return self._reject(f"cannot read {self.path}: {exc.strerror}", "missing")
            if (st.st_mtime_ns, st.st_size) == self._stat_sig:
                return False
            try:
                text = self._read()
            except OSError as exc:
                return self._reject(f"cannot read {self.path}: {exc.strerror}", "unreadable")
            digest = hashlib.sha256(text.encode()).hexdigest()
            self._stat_sig = (st.st_mtime_ns, st.st_size)
            if digest == self._content_hash:      # touched, or restored after an error
                self._last_error = self._last_error_at = None
                self._rejected_hash = ""
                return False
            if digest == self._rejected_hash:
                return False
            try:
                config = parse_tenants_text(text, str(self.path))
            except TenantsFileError as exc:
                return self._reject(str(exc), digest)
            self._snap = _Snapshot.build(config, self._snap.version + 1)
            self._content_hash, self._rejected_hash = digest, ""
            self._loaded_at = self._clock()
            self._last_error = self._last_error_at = None
            version = self._snap.version
        log.info("tenants file %s reloaded: version %d, %d tenants", self.path, version,
                 len(config.tenants))
        for fn in list(self._listeners):
            fn(config, version)
        return True

    async def watch(self, interval_s: float = 2.0) -> None:
        """Poll ``reload_if_changed`` until cancelled, or until the loop's thread pool is shut
        down (the process is exiting: Serve stops a replica that way), then return quietly."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await asyncio.to_thread(self.reload_if_changed)
            except Exception as exc:  # noqa: BLE001 - a listener bug must not kill the watcher
                if isinstance(exc, RuntimeError) and ("after shutdown" in str(exc)
                                                      or "after interpreter shutdown" in str(exc)):
                    log.debug("tenants watcher stops: the thread pool is shut down")
                    return
                log.exception("tenants reload listener failed")

    def _reject(self, message: str, content_id: str) -> bool:
        if content_id != self._rejected_hash:
            log.error("tenants file rejected, keeping version %d: %s", self._snap.version, message)
        self._rejected_hash = content_id
        self._last_error, self._last_error_at = message, self._clock()
        return False

    def _read(self) -> str:
        st = self.path.stat()
        text = self.path.read_text(encoding="utf-8")
        self._stat_sig = (st.st_mtime_ns, st.st_size)
        return text
