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
