"""What the engine tells the prefix directory about its KV tiers (``Engine.drain_kv_events``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class KVEvents:
    """Block hashes stored in / removed from one KV tier ("device" or "host") since the
    previous batch of that tier; ``seq_no`` counts batches of all tiers together.

    ``closed``: on a device batch, whether the device cache is prefix-closed after it (every
    cached block's parent cached too; ``BlockPool.prefix_closed``); None on a host batch.
    """

    seq_no: int
    stored: list
    removed: list
    tier: str = "device"
    closed: bool | None = None


def drain_tiers(pool, host, first_seq: int) -> list[KVEvents]:
    """Event batches of the device ``pool`` and the ``host`` tier (None: off) since their last
    drain: at most one per tier, host first, none if empty, numbered from ``first_seq``.

    Host comes first so that a block moving device -> host is stored in the host tier before
    it is removed from the device tier.
    """
    batches = []
    tiers = [("host", host)] if host is not None else []
    for tier, source in tiers + [("device", pool)]:
        stored, removed = source.drain_events()
        if stored or removed:
            closed = pool.prefix_closed if tier == "device" else None
            batches.append(KVEvents(first_seq + len(batches), stored, removed, tier, closed))
    return batches
