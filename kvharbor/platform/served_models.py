"""The models a gateway serves: its base model and the LoRA adapters beside it (build_app's
``lora_modules``, then tenants.yaml's ``lora_adapters``), their ``/v1/models`` cards, the 404
for any other name, and the cache scope of an adapter's blocks."""

from __future__ import annotations

from kvharbor.engine.hashing import adapter_salt, with_request_salt
from kvharbor.platform.error_body import APIError
from kvharbor.tenants import TenantRegistry


class ServedModels:
    """``base`` and its adapters; tenants.yaml's are re-read when the registry reloads."""

    def __init__(self, base: str, lora_modules: dict[str, str] | None, registry: TenantRegistry,
                 context: int, served_names: list[str] | None = None) -> None:
        """``served_names``: the names requests give the base model (vLLM's
        ``served_model_name``; None: ``base``, the model's id or path, itself)."""
        self.base, self.static, self.registry, self.context = base, dict(lora_modules or {}), registry, context
        self.base_names = list(served_names or [base])
        self._adapters: tuple[int, dict[str, str]] = (0, {})   # (registry version, name -> directory)

    @property
    def adapters(self) -> dict[str, str]:
        """LoRA name -> checkpoint directory; ``lora_modules`` wins a name both hold, as in the
        replicas."""
        version, adapters = self._adapters
        if version != self.registry.version:
            adapters = dict(self.static)
            adapters.update((k, v) for k, v in self.registry.lora_adapters().items() if k not in adapters)
            self._adapters = (self.registry.version, adapters)
        return adapters

    def names(self) -> list[str]:
        return [*self.base_names, *self.adapters]

    def check(self, model: str) -> None:
        """Raise the 404 (``model_not_found``) for a model this server does not serve."""
        if model not in self.base_names and model not in self.adapters:
            served = ", ".join(repr(m) for m in self.names())
            raise APIError(404, f"model {model!r} does not exist; this server serves {served} "
                           "(see GET /v1/models)", "model_not_found", "model")

    def card(self, model: str) -> dict:
        """The model's card, its ``root`` the model's id or path; a LoRA adapter's names its
        directory and base model, as vLLM's."""
        adapter = model in self.adapters
        return {"id": model, "object": "model", "created": 0, "owned_by": "kvharbor",
                "max_model_len": self.context, "root": self.adapters[model] if adapter else self.base,
                "parent": self.base_names[0] if adapter else None}

    def adapter(self, model: str) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model)."""
        return None if model in self.base_names else model

    def answered_name(self, model: str) -> str:
        """The ``model`` an answer gives for a request of ``model``: the base model's first
        served name whichever of its names was asked for (as vLLM), else the adapter's."""
        return self.base_names[0] if model in self.base_names else model

    def salt(self, cache_salt: str | None, adapter: str | None, request_salt: str | None = None) -> str | None:
        """The salt of a request of ``adapter`` in scope ``cache_salt`` sending its own
        ``request_salt``, as the engine hashes its blocks (so the router matches them)."""
        return adapter_salt(with_request_salt(cache_salt, request_salt), adapter,
                            adapter and self.adapters[adapter])
