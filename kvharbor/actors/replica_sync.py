"""What a replica keeps in sync with the outside: the prefix directory (tenants.yaml:
``kvharbor.actors.tenant_sync``)."""

from __future__ import annotations

import asyncio
import logging

import ray

from kvharbor.actors.prefix_directory import shard_name, shard_of
from kvharbor.engine.tokenizer import chat_token_ids
from kvharbor.observability.metrics import get_metrics

logger = logging.getLogger("kvharbor.replica")


def system_prompt_tokens(tokenizer, text: str) -> list[int]:
    """Tokens a chat that opens with ``text`` as its system message starts with."""
    return chat_token_ids(tokenizer, [{"role": "system", "content": text}], add_generation_prompt=False)


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
        if not batches or self._resync_due:    # the snapshot due covers them (due from start)
            return
        for events in batches:
            self._pending.append(self._handle.apply_events.remote(
                self.replica_id, events.seq_no, events.stored, events.removed, events.tier,
                events.closed))

    def prepare(self, engine):
        """Submit a resync if one is due (engine lock held; does not wait). Returns its ref."""
        if not self._resync_due or self._handle is None:
            return None
        engine.drain_kv_events()          # the snapshot covers everything drained so far
        ref = self._handle.resync.remote(self.replica_id, engine.last_event_seq,
                                         {"device": list(engine.cached_block_hashes()),
                                          "host": list(engine.host_block_hashes())},
                                         engine.pool.prefix_closed)
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
