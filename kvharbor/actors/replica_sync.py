"""What a replica keeps in sync with the outside: the prefix directory (tenants.yaml:
``kvharbor.actors.tenant_sync``)."""

from __future__ import annotations

import asyncio
import logging

import ray

logger = logging.getLogger("kvharbor.replica")


def system_prompt_tokens(tokenizer, text: str) -> list[int]:
    """Tokens a chat that opens with ``text`` as its system message starts with."""
    ids = tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=True,
                                        add_generation_prompt=False)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


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
