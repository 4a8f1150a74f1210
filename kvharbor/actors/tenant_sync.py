"""What a replica takes from tenants.yaml: QoS classes, the pinned region's bounds, pinned
prefixes, LoRA adapters.

Region bounds: the floor is ``max(engine pinned_kv_blocks, sum of tenants' pinned_kv_blocks,
pinned_region.floor_blocks)``; the ceiling is ``pinned_region.ceiling_blocks``, else the
engine's own ``pinned_kv_blocks_max`` (None: a fixed region of the floor), at start and
after every reload alike. Between them the engine sizes the region by premium demand
(``kvharbor.engine.pinned_sizer``) and retries every step until it has its target size.

A reload applies, in this order: QoS classes; release of prefixes no longer configured (so
their blocks can move); new bounds and an immediate resize attempt; then new prefixes (so
they land in the grown region). ``tick`` retries the resize while the engine is idle. LoRA
adapters are loaded after that, off the engine lock (``sync_adapters``).
"""

from __future__ import annotations

import logging

from kvharbor.actors.replica_sync import system_prompt_tokens
from kvharbor.config import EngineConfig, QoSSpec
from kvharbor.tenants import TenantRegistry
from kvharbor.tenants.loader import TenantsFileError, load_tenants_file

logger = logging.getLogger("kvharbor.replica")


def qos_specs(registry: TenantRegistry) -> dict[str, QoSSpec]:
    return {name: QoSSpec(priority=q.priority, pinned=q.pinned, preemptible=q.preemptible,
                          ttft_slo_ms=q.ttft_slo_ms, step_target_ms=q.step_target_ms)
            for name, q in registry.config.qos_classes.items()}


class TenantSync:
    """QoS classes, the pinned region's bounds and pinned prefixes, from tenants.yaml."""

    def __init__(self, path: str) -> None:
        self.registry = TenantRegistry(path)
        self.base_pinned = 0
        self.base_ceiling: int | None = None        # the engine's own pinned_kv_blocks_max
        self.pinned: dict[tuple, list] = {}       # (tenant, text, cache salt, class) -> blocks

    def floor(self) -> int:
        region = self.registry.config.pinned_region
        return max(self.base_pinned, self.registry.pinned_kv_blocks_total(), region.floor_blocks)

    def ceiling(self) -> int | None:
        """``pinned_region.ceiling_blocks``, else the engine's own (None: a fixed region)."""
        region = self.registry.config.pinned_region
        return region.ceiling_blocks if region.ceiling_blocks is not None else self.base_ceiling

    def apply_to_config(self, config: EngineConfig) -> EngineConfig:
        self.base_pinned, self.base_ceiling = config.pinned_kv_blocks, config.pinned_kv_blocks_max
        region = self.registry.config.pinned_region
        return config.model_copy(update={
            "qos_classes": qos_specs(self.registry), "pinned_kv_blocks": self.floor(),
            "pinned_kv_blocks_max": self.ceiling(), "pinned_demand_window_s": region.demand_window_s})

    def pin_prefixes(self, engine) -> None:
        """Release prefixes no longer configured, then pin every configured one not pinned yet."""
        wanted = self._wanted()
        self._release_removed(engine, wanted)
        for key in wanted:
            if key in self.pinned:
                continue
            name, text, salt, qos = key
            tokens = system_prompt_tokens(engine.tokenizer, text)
            try:
                engine.pin_prefix(tokens, qos=qos, cache_salt=salt)
                self.pinned[key] = engine.pinned_prefixes[-1]
            except (RuntimeError, ValueError) as e:
                logger.error("cannot pin prefix of tenant %s: %s", name, e)

    def sync_adapters(self, engine) -> None:
        """Serve tenants.yaml's LoRA adapters: load new ones (and one whose path changed),
        stop serving removed ones; build_app's ``lora_modules`` stay as loaded. A checkpoint
        that fails to load is logged, and its requests get the reason."""
        static = engine.config.lora_modules
        wanted = {n: p for n, p in self.registry.lora_adapters().items() if n not in static}
        for name in [n for n in engine.loras.adapters if n not in wanted and n not in static]:
            engine.loras.remove(name)
            logger.info("LoRA adapter %s is no longer served (removed from tenants.yaml)", name)
        for name, path in wanted.items():
            self._load_adapter(engine, name, path)

    def ensure_adapter(self, engine, name: str) -> None:
        """Load adapter ``name`` now if tenants.yaml lists it and it is not loaded yet (a
        request for it arrived before this replica's next reload); read from the file itself,
        so the registry's own reload still applies the rest of the edit."""
        if name in engine.loras.adapters or name in engine.config.lora_modules:
            return
        try:
            paths = load_tenants_file(self.registry.path).lora_adapter_paths(self.registry.path.parent)
        except TenantsFileError:
            return
        if name in paths:
            self._load_adapter(engine, name, paths[name])

    @staticmethod
    def _load_adapter(engine, name: str, path: str) -> None:
        if engine.loras.loaded_from(name, path):
            return
        engine.loras.remove(name)               # a new checkpoint under the name, if loaded
        try:
            engine.add_lora(name, path)
            logger.info("LoRA adapter %s loaded from %s", name, path)
        except ValueError as e:
            logger.error("cannot load LoRA adapter %s: %s", name, e)

    def apply_session_limits(self, engine) -> None:
        """Each tenant's session ttl and idle-block cap (tenant value, else its class's)."""
        config = self.registry.config
        for name, tenant in config.tenants.items():
            ttl, cap = tenant.session_limits(config.qos_classes[tenant.qos])
            engine.set_session_limits(name, ttl, cap)

    def _wanted(self) -> dict[tuple, None]:
        """Each configured prefix as (tenant, text, cache salt, class), in the file's order: a
        tenant moved to another cache scope or class has its prefixes pinned again there (the
        old copies are released as removed ones)."""
        return dict.fromkeys((name, text, self.registry.cache_salt(name), tenant.qos)
                             for name, tenant in self.registry.config.tenants.items()
                             for text in tenant.pinned_prefixes)

    def _release_removed(self, engine, wanted: dict[tuple, None]) -> None:
        for key in list(self.pinned):
            if key not in wanted:
                engine.unpin_prefix(self.pinned.pop(key))

    def maybe_reload(self, engine) -> bool:
        """Apply a changed tenants.yaml (see module doc for the order)."""
        if not self.registry.reload_if_changed():
            self.tick(engine)
            return False
        engine.set_qos_classes(qos_specs(self.registry))
        self.apply_session_limits(engine)
        self._release_removed(engine, self._wanted())
        region = self.registry.config.pinned_region
        sizer = engine.scheduler.sizer
        sizer.floor, sizer.ceiling, sizer.window_s = self.floor(), self.ceiling(), region.demand_window_s
        self.tick(engine)
        self.pin_prefixes(engine)
        return True

    def tick(self, engine) -> None:
        """Retry the region's resize (the scheduler does it every step; this covers idle time)."""
        got, want = engine.resize_pinned_region()
        if got != want:
            logger.info("pinned region is %d blocks, target %d (blocks busy; retrying)", got, want)
