"""Tenants: the ``tenants.yaml`` schema, API keys, the live registry, and admission limits.

No Ray here except :mod:`kvharbor.tenants.admission_actor` (imported lazily below).

    registry = TenantRegistry("tenants.yaml")            # auth, model check, hot reload
    principal = registry.authenticate(bearer_key)        # AuthError (401)
    registry.check_model(principal, model)               # ForbiddenError (403)
    admission = LocalAdmission() | ActorAdmission(get_or_create_admission_actor())
    result = await admission.try_admit(principal.tenant, principal.limits, n_prompt, max_tokens)
"""

from kvharbor.tenants.errors import AuthError, ForbiddenError, TenantError
from kvharbor.tenants.keys import DEMO_KEYS, KeyHash, generate_key, hash_key, key_matches
from kvharbor.tenants.limits import Admission, AdmissionController, LocalAdmission, Ticket
from kvharbor.tenants.loader import (ConfigIssue, TenantsFileError, load_tenants_file,
                                     parse_tenants_text)
from kvharbor.tenants.registry import Principal, TenantRegistry, cache_salt_for, describe_tenant
from kvharbor.tenants.schema import (ApiKeyEntry, LimitsConfig, QoSClassConfig, TenantConfig,
                                     TenantId, TenantLimits, TenantsFile)

__all__ = [
    "Admission", "AdmissionController", "ActorAdmission", "AdmissionActor", "ApiKeyEntry",
    "AuthError", "ConfigIssue", "DEMO_KEYS", "ForbiddenError", "KeyHash", "LimitsConfig",
    "LocalAdmission", "Principal", "QoSClassConfig", "TenantConfig", "TenantError", "TenantId",
    "TenantLimits", "TenantRegistry", "TenantsFile", "TenantsFileError", "Ticket",
    "cache_salt_for", "default_tenants_path", "describe_tenant", "generate_key", "get_or_create_admission_actor",
    "hash_key", "key_matches", "load_tenants_file", "parse_tenants_text",
]

_ACTOR_NAMES = ("ActorAdmission", "AdmissionActor", "get_or_create_admission_actor")


def __getattr__(name: str):
    """Import the Ray actor module only when one of its names is used."""
    if name in _ACTOR_NAMES:
        from kvharbor.tenants import admission_actor

        return getattr(admission_actor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_tenants_path():
    """``./tenants.yaml`` if it exists, else the packaged example (a ``pathlib.Path``)."""
    from importlib.resources import files
    from pathlib import Path

    local = Path("tenants.yaml")
    if local.is_file():
        return local
    return Path(str(files("kvharbor") / "data" / "tenants.yaml"))
