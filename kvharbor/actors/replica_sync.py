"""What a replica keeps in sync with the outside: tenants.yaml and the prefix directory."""

from __future__ import annotations

import asyncio
import logging

import ray

from kvharbor.config import EngineConfig, QoSSpec
from kvharbor.tenants import TenantRegistry, cache_salt_for

logger = logging.getLogger("kvharbor.replica")


def qos_specs(registry: TenantRegistry) -> dict[str, QoSSpec]:
    return {name: QoSSpec(priority=q.priority, pinned=q.pinned, preemptible=q.preemptible)
            for name, q in registry.config.qos_classes.items()}


def system_prompt_tokens(tokenizer, text: str) -> list[int]:
    """Tokens a chat that opens with ``text`` as its system message starts with."""
    ids = tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=True,
                                        add_generation_prompt=False)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


class TenantSync:
    """QoS classes, the pinned region size and pinned prefixes, from tenants.yaml.

    The region is ``max(engine pinned_kv_blocks, sum of tenants' pinned_kv_blocks)``; each
    tenant's pinned prefixes are prefilled once per replica and never evicted.
    """

    def __init__(self, path: str) -> None:
        self.registry = TenantRegistry(path)
        self.base_pinned = 0
        self.pinned: dict[tuple[str, str], list] = {}       # (tenant, text) -> blocks

    def apply_to_config(self, config: EngineConfig) -> EngineConfig:
        self.base_pinned = config.pinned_kv_blocks
        pinned = max(config.pinned_kv_blocks, self.registry.pinned_kv_blocks_total())
        return config.model_copy(update={"qos_classes": qos_specs(self.registry),
                                         "pinned_kv_blocks": pinned})

    def pin_prefixes(self, engine) -> None:
        """Pin every configured prefix not pinned yet; release those no longer configured."""
        wanted = {}
        for name, tenant in self.registry.config.tenants.items():
            for text in tenant.pinned_prefixes:
                wanted[(name, text)] = (tenant, name)
        for key in list(self.pinned):
            if key not in wanted:
                engine.pool.release(self.pinned.pop(key))
        for (name, text), (tenant, _) in wanted.items():
            if (name, text) in self.pinned:
                continue
            tokens = system_prompt_tokens(engine.tokenizer, text)
            try:
                engine.pin_prefix(tokens, qos=tenant.qos, cache_salt=cache_salt_for(tenant, name))
                self.pinned[(name, text)] = engine.pinned_prefixes[-1]
            except (RuntimeError, ValueError) as e:
                logger.error("cannot pin prefix of tenant %s: %s", name, e)

    def maybe_reload(self, engine) -> bool:
        """Apply a changed tenants.yaml: QoS classes, region size, pinned prefixes."""
        if not self.registry.reload_if_changed():
            return False
        specs = qos_specs(self.registry)
        engine.config = engine.config.model_copy(update={"qos_classes": specs})
        engine.scheduler.preemptible = {k: q.preemptible for k, q in specs.items()}
        target = max(self.base_pinned, self.registry.pinned_kv_blocks_total())
        got = engine.pool.resize_pinned(target)
        if got != target:
            logger.warning("pinned region is %d blocks, wanted %d (blocks busy; retrying later)", got, target)
        self.pin_prefixes(engine)
        return True


class DirectorySync:
    """Sends the engine's KV events to the PrefixDirectory, in order, and resyncs on a gap.

    Batches of both tiers ("device", "host") share the replica's one sequence counter, so the
    directory sees a gap in either; a resync sends a snapshot of both tiers.
    """

    def __init__(self, name: str, replica_id: str, namespace: str | None = None) -> None:
        self.name, self.namespace = name, namespace
        self.replica_id = replica_id
        self._handle = None
        self._pending: list = []
        self._resync_due = True           # a (re)started replica starts from a snapshot

    def _actor(self):
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        return self._handle

    def publish(self, engine) -> None:
        batches = engine.drain_kv_events()
        if not batches or self._resync_due:
            return
        try:
            actor = self._actor()
            for events in batches:
                self._pending.append(actor.apply_events.remote(
                    self.replica_id, events.seq_no, events.stored, events.removed, events.tier))
        except ValueError:                # directory not found: resync once it is back
            self._resync_due = True

    async def maybe_resync(self, engine) -> None:
        """Check applied batches; after a gap (or at start) send a full snapshot."""
        pending, self._pending = self._pending, []
        try:
            results = await asyncio.gather(*pending) if pending else []
        except Exception:  # noqa: BLE001 - directory died: snapshot when it is back
            results = [False]
        if all(results) and not self._resync_due:
            return
        try:
            engine.drain_kv_events()      # the snapshot covers everything drained so far
            await self._actor().resync.remote(self.replica_id, engine.last_event_seq,
                                              {"device": list(engine.cached_block_hashes()),
                                               "host": list(engine.host_block_hashes())})
            self._resync_due = False
        except Exception as e:  # noqa: BLE001
            self._handle = None
            self._resync_due = True
            logger.warning("prefix directory resync failed: %r", e)
