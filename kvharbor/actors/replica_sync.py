"""What a replica keeps in sync with the outside: tenants.yaml and the prefix directory."""

from __future__ import annotations

import asyncio
import logging

import ray

from kvharbor.actors.prefix_directory import shard_name, shard_of
from kvharbor.config import EngineConfig, QoSSpec
from kvharbor.observability.metrics import get_metrics
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
    """Sends the engine's KV events to the directory shard that owns this replica, in order,
    and resyncs (a full snapshot) at start, after a gap, a failed or late call, or when the
    directory no longer knows the replica (it restarted, or a router told it to forget).

    Batches of both tiers ("device", "host") share the replica's one sequence counter, so the
    directory sees a gap in either; a resync sends a snapshot of both tiers.

    Lock discipline: ``publish`` and ``prepare`` run while the replica holds its engine lock
    and never wait: they read engine state and *submit* actor calls (Ray keeps one caller's
    calls in submission order, so a resync submitted before later batches is applied before
    them). ``settle`` awaits the results, each with ``timeout_s``, after the lock is released:
    a slow or dead directory delays only the next resync, never token generation.
    """

    def __init__(self, name: str, replica_id: str, namespace: str | None = None,
                 num_shards: int = 1, timeout_s: float = 2.0) -> None:
        self.name = shard_name(name, shard_of(replica_id, num_shards), num_shards)
        self.namespace, self.replica_id, self.timeout_s = namespace, replica_id, timeout_s
        self._handle = None
        self._pending: list = []          # apply_events refs not yet checked
        self._resync_due = True           # a (re)started replica starts from a snapshot
        self.resyncs = 0

    def publish(self, engine) -> None:
        """Submit this step's event batches (engine lock held; does not wait)."""
        batches = engine.drain_kv_events()
        if not batches or self._resync_due:
            return
        if self._handle is None:          # the snapshot at the next resync covers them
            self._resync_due = True
            return
        for events in batches:
            self._pending.append(self._handle.apply_events.remote(
                self.replica_id, events.seq_no, events.stored, events.removed, events.tier))

    def prepare(self, engine):
        """Submit a resync if one is due (engine lock held; does not wait). Returns its ref."""
        if not self._resync_due or self._handle is None:
            return None
        engine.drain_kv_events()          # the snapshot covers everything drained so far
        ref = self._handle.resync.remote(self.replica_id, engine.last_event_seq,
                                         {"device": list(engine.cached_block_hashes()),
                                          "host": list(engine.host_block_hashes())})
        self._resync_due, self._pending = False, []     # earlier batches are superseded
        self.resyncs += 1
        get_metrics().directory_resync("replica_resync")
        return ref

    async def settle(self, resync_ref=None) -> None:
        """Await submitted calls and check the directory still knows this replica (no lock).

        Any failure, timeout, refused batch or unknown replica makes the next ``prepare``
        send a snapshot.
        """
        pending, self._pending = self._pending, []
        try:
            if self._handle is None:
                self._handle = await asyncio.wait_for(asyncio.to_thread(self._get_actor),
                                                      self.timeout_s)
                self._resync_due = True
                return
            calls = pending + ([resync_ref] if resync_ref is not None else [])
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True),
                                             self.timeout_s) if calls else []
            _, known = await asyncio.wait_for(self._handle.heartbeat.remote(self.replica_id),
                                              self.timeout_s)
            failed = any(isinstance(r, BaseException) for r in results)
            if failed or not known or not all(results[:len(pending)]):
                self._resync_due = True
        except Exception as e:  # noqa: BLE001 - timeout, dead/restarting or missing directory
            self._resync_due = True
            logger.warning("prefix directory %s unreachable (%r); will resync", self.name, e)

    def close(self) -> None:
        """Best effort on shutdown: the directory forgets this replica's blocks."""
        if self._handle is not None:
            self._handle.remove_replica.remote(self.replica_id)

    def _get_actor(self):
        return ray.get_actor(self.name, namespace=self.namespace)
