"""The ``tenants.yaml`` schema (pydantic v2, unknown fields rejected so typos are caught).

Shape::

    qos_classes: {name: QoSClassConfig}     # priority: higher = more important
    defaults:    LimitsConfig               # limits for tenants that omit a field
    admin_keys:  [ApiKeyEntry | "<sha256>"]
    tenants:     {name: TenantConfig}       # keys, qos, limits, cache scope, pinned prompts
    lora_adapters: {name: {path: dir}}      # LoRA adapters served beside the model

Limit fields follow one rule: a tenant that *omits* a field inherits it from ``defaults``; a
tenant that sets it to ``null`` has no limit of that kind. :meth:`TenantsFile.limits_for`
resolves it into a :class:`TenantLimits`.

Cross-field checks (:func:`cross_field_issues`) report each problem with its field path, so
the loader can point at a file line. ``TenantsFile.model_validate`` runs them too, unless the
validation context holds ``{"defer_cross_checks": True}`` (the loader's way of reporting them
one by one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal, NewType

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvharbor.tenants.keys import looks_like_key_hash

TenantId = NewType("TenantId", str)
QoSName = NewType("QoSName", str)

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
CACHE_SECRET_RE = r"^[0-9a-f]{32,128}$"
CACHE_SCOPE_RE = re.compile(r"^(private|public|shared:[A-Za-z0-9][A-Za-z0-9_.-]{0,63})$")
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests",
                "max_tokens_per_request", "daily_token_budget")

Name = Annotated[str, Field(pattern=NAME_RE, description="letters, digits, '_', '.', '-'")]
Count = Annotated[int, Field(ge=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)


class QoSClassConfig(_Strict):
    """A quality-of-service class; every tenant belongs to exactly one."""

    priority: int = Field(description="Scheduling priority; HIGHER numbers are served first.")
    pinned: bool = Field(False, description="Requests may use the reserved (pinned) KV region.")
    ttft_slo_ms: float | None = Field(None, gt=0, description="Time-to-first-token target, ms. "
                                      "While requests of this class are about, engine steps are kept "
                                      "under half of it (lower classes' work is trimmed to fit).")
    step_target_ms: float | None = Field(None, gt=0, description="Longest estimated engine step, ms, "
                                         "while requests of this class are about (default: "
                                         "ttft_slo_ms / 2).")
    preemptible: bool = Field(False, description="Running requests may be preempted for "
                                                 "higher classes.")
    max_queue: int = Field(1000, ge=0, description="Most requests of this class that may wait "
                                                   "in one replica's queue.")
    stream_interval: int = Field(1, ge=1, description="Tokens per streamed chunk after the first "
                                 "(the first token and the end go at once). Above 1, each chunk's "
                                 "work in the replica, gateway, proxy and client is paid once per "
                                 "that many tokens: for classes whose clients read whole answers.")
    session_ttl_s: float | None = Field(None, gt=0, description="Seconds an idle session (X-Session-ID) "
                                        "keeps its KV blocks referenced (None: the engine default, 300).")
    session_max_blocks: int | None = Field(None, ge=0, description="Most KV blocks one tenant's idle "
                                           "sessions may hold per replica, oldest released first "
                                           "(None: the engine default, half the KV blocks).")


class ApiKeyEntry(_Strict):
    """One API key, stored only as its SHA-256 hex digest. A bare string means ``{hash: ...}``."""

    hash: str = Field(description="SHA-256 hex digest of the key (never the key itself).")
    label: str | None = Field(None, description="Free-form note for admins, e.g. 'ci'.")
    created: datetime | None = Field(None, description="When the key was issued (UTC).")
    expires: datetime | None = Field(None, description="Key is refused from this time on "
                                                       "(UTC if no zone is given).")
    revoked: bool | str = Field(False, description="true, or a reason string: key is refused.")

    @model_validator(mode="before")
    @classmethod
    def _bare_hash(cls, data: Any) -> Any:
        return {"hash": data} if isinstance(data, str) else data

    @field_validator("hash")
    @classmethod
    def _is_hex_digest(cls, value: str) -> str:
        if not looks_like_key_hash(value):
            raise ValueError("must be a lowercase 64-char SHA-256 hex digest of the key "
                             "(`kvharbor tenants hash-key`), never the key itself")
        return value

    @field_validator("created", "expires")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value

    def is_revoked(self) -> bool:
        """True if ``revoked`` is true or a non-empty reason."""
        return bool(self.revoked)

    def is_expired(self, now_s: float) -> bool:
        """True if the key has an expiry at or before ``now_s`` (Unix seconds)."""
        return self.expires is not None and self.expires.timestamp() <= now_s


class LimitsConfig(_Strict):
    """Per-tenant limits; ``null`` means unlimited."""

    requests_per_minute: Count | None = Field(None, description="Requests admitted per minute "
                                              "(token bucket: bursts up to this many).")
    tokens_per_minute: Count | None = Field(None, description="Prompt + max_tokens per minute.")
    max_concurrent_requests: Count | None = Field(None, description="Requests in flight at once.")
    max_tokens_per_request: Count | None = Field(None, description="Largest `max_tokens` "
                                                 "(completion tokens) one request may ask for.")
    daily_token_budget: Count | None = Field(None, description="Tokens (prompt + generated) "
                                             "per UTC day.")


class TenantConfig(LimitsConfig):
    """One customer: its keys, QoS class, models, limits and KV-cache policy."""

    keys: list[ApiKeyEntry] = Field(default_factory=list, description="API keys (hashed).")
    qos: Name = Field(description="Name of a class in `qos_classes`.")
    allowed_models: list[str] | None = Field(None, description="Model ids this tenant may use; "
                                             "empty or null = all models.")
    cache_scope: str = Field("private", description="Who shares this tenant's KV cache: "
                             "'private', 'shared:<group>' or 'public'.")
    cache_secret: str | None = Field(None, pattern=CACHE_SECRET_RE, description="Random salt of this "
                                     "tenant's private cache scope (written by `kvharbor tenants add`; "
                                     "a re-created tenant gets a new one, so it never inherits the old "
                                     "cache). Absent: the tenant's name is the salt (older files).")
    pinned_prefixes: list[str] = Field(default_factory=list, description="System prompts "
                                       "prefilled once and kept in the pinned KV region.")
    pinned_kv_blocks: int = Field(0, ge=0, description="KV blocks reserved for this tenant in "
                                  "the pinned region (pinned QoS classes only).")
    session_ttl_s: float | None = Field(None, gt=0, description="Idle session lifetime, seconds "
                                        "(None: the QoS class's value).")
    session_max_blocks: int | None = Field(None, ge=0, description="Cap on KV blocks held by this "
                                           "tenant's idle sessions per replica (None: the class's value).")
    context_overflow: Literal["error", "truncate_oldest"] = Field(
        "error", description="A chat longer than the context: 'error' (400) or 'truncate_oldest' "
        "(drop the oldest turns, keep the system prompt; the reply says how many tokens were dropped).")

    def session_limits(self, qos: QoSClassConfig) -> tuple[float | None, int | None]:
        """(ttl_s, max_blocks) for this tenant's sessions: its own value, else its class's."""
        ttl = self.session_ttl_s if self.session_ttl_s is not None else qos.session_ttl_s
        cap = self.session_max_blocks if self.session_max_blocks is not None else qos.session_max_blocks
        return ttl, cap

    @field_validator("cache_scope")
    @classmethod
    def _scope_syntax(cls, value: str) -> str:
        if not CACHE_SCOPE_RE.match(value):
            raise ValueError(f"cache_scope {value!r} is not 'private', 'public' or "
                             "'shared:<group>' (group: letters, digits, '_', '.', '-')")
        return value


@dataclass(slots=True, frozen=True)
class TenantLimits:
    """A tenant's effective limits after applying ``defaults`` (None = unlimited)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_tokens_per_request: int | None = None
    daily_token_budget: int | None = None

    @classmethod
    def coerce(cls, obj: Any) -> TenantLimits:
        """Build from a TenantLimits, a dict, or any object with the five limit attributes."""
        if isinstance(obj, TenantLimits):
            return obj
        if obj is None:
            return cls()
        get = obj.get if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))
        return cls(**{k: get(k, None) for k in LIMIT_FIELDS})

    def as_dict(self) -> dict[str, int | None]:
        return {k: getattr(self, k) for k in LIMIT_FIELDS}


class PinnedRegionConfig(_Strict):
    """The pinned KV region sized by load, per replica (blocks)."""

    floor_blocks: int = Field(0, ge=0, description="Smallest region (the tenants' pinned_kv_blocks "
                              "reservations count too: the floor is the larger of the two).")
    ceiling_blocks: int | None = Field(None, ge=0, description="Largest region; the region follows "
                                       "peak premium demand between floor and ceiling. None: a fixed "
                                       "region of the floor.")
    demand_window_s: float = Field(30.0, gt=0, description="Window of the peak demand, seconds.")


class CacheScopeConfig(_Strict):
    """A shared cache scope (``shared:<group>``): its random salt."""

    secret: str = Field(pattern=CACHE_SECRET_RE, description="Random salt of the group's cache "
                        "scope (written by `kvharbor tenants add --cache-scope shared:<group>`).")


class LoRAAdapterConfig(_Strict):
    """A LoRA adapter every replica serves beside the model; requests name it as their model."""

    path: str = Field(min_length=1, description="PEFT checkpoint directory (adapter_config.json and "
                      "adapter_model.safetensors); a relative path is read from tenants.yaml's "
                      "directory. The name and path identify the adapter's cached KV: to change "
                      "its weights, point it at a new directory.")


class TenantsFile(_Strict):
    """The whole ``tenants.yaml``."""

    qos_classes: dict[Name, QoSClassConfig] = Field(min_length=1, description="QoS classes.")
    defaults: LimitsConfig = Field(default_factory=LimitsConfig,
                                   description="Limits for tenants that omit a field.")
    admin_keys: list[ApiKeyEntry] = Field(default_factory=list,
                                          description="Keys allowed on /admin routes (hashed).")
    tenants: dict[Name, TenantConfig] = Field(default_factory=dict, description="Tenants.")
    cache_scopes: dict[Name, CacheScopeConfig] = Field(default_factory=dict, description=
                                                       "Shared cache scopes by group name: their salts.")
    pinned_region: PinnedRegionConfig = Field(default_factory=PinnedRegionConfig,
                                              description="Pinned region sizing per replica.")
    lora_adapters: dict[Name, LoRAAdapterConfig] = Field(default_factory=dict, description=
                                                         "LoRA adapters by name (loaded by every "
                                                         "replica within seconds of an edit).")

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> TenantsFile:
        if info.context and info.context.get("defer_cross_checks"):
            return self
        issues = cross_field_issues(self)
        if issues:
            raise ValueError("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in issues))
        return self

    def lora_adapter_paths(self, base: Path) -> dict[str, str]:
        """Each LoRA adapter's checkpoint directory, relative paths read from ``base``."""
        return {name: str(base / a.path) for name, a in self.lora_adapters.items()}

    def limits_for(self, tenant: str) -> TenantLimits:
        """Effective limits of ``tenant``: its own fields where set, else ``defaults``."""
        cfg = self.tenants[tenant]
        return TenantLimits(**{
            k: getattr(cfg if k in cfg.model_fields_set else self.defaults, k) for k in LIMIT_FIELDS})


Loc = tuple[str | int, ...]


def cross_field_issues(data: TenantsFile) -> list[tuple[Loc, str]]:
    """Problems that span fields, each with the path of the field to fix.

    Checks: unknown QoS class; the same key hash used twice (across tenants and admin keys);
    pinned KV blocks or pinned prefixes on a tenant whose class is not ``pinned``.
    """
    issues: list[tuple[Loc, str]] = []
    seen: dict[str, Loc] = {}

    def check_key(loc: Loc, key_hash: str) -> None:
        if key_hash in seen:
            first = ".".join(map(str, seen[key_hash]))
            issues.append((loc, f"key hash {key_hash[:8]}... is already used at {first}; "
                                "every key must be unique"))
        else:
            seen[key_hash] = loc

    for i, entry in enumerate(data.admin_keys):
        check_key(("admin_keys", i, "hash"), entry.hash)
    for name, tenant in data.tenants.items():
        for i, entry in enumerate(tenant.keys):
            check_key(("tenants", name, "keys", i, "hash"), entry.hash)
        qos = data.qos_classes.get(tenant.qos)
        if qos is None:
            issues.append((("tenants", name, "qos"), f"unknown QoS class {tenant.qos!r}; "
                           f"define it under qos_classes or use one of {sorted(data.qos_classes)}"))
            continue
        if not qos.pinned and tenant.pinned_kv_blocks > 0:
            issues.append((("tenants", name, "pinned_kv_blocks"),
                           f"class {tenant.qos!r} is not pinned; set pinned_kv_blocks to 0 or "
                           "move the tenant to a class with `pinned: true`"))
        if not qos.pinned and tenant.pinned_prefixes:
            issues.append((("tenants", name, "pinned_prefixes"),
                           f"class {tenant.qos!r} is not pinned; pinned prefixes need a class "
                           "with `pinned: true`"))
    return issues
