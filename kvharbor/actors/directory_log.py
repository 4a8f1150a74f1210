"""The directory's event log: what routers replay to keep their own ``PrefixIndex`` current.

The ``PrefixDirectory`` actor appends every change it applies to its index (an event batch
it accepted, a resync, a forgotten replica) to this log, in the order it applied them.
A router polls ``read(epoch, cursor)`` and replays the entries into its local index, so
after replaying up to offset ``n`` its index equals the directory's index after change
``n`` (the LRU order aside, which each index keeps from its own matches)::

    offset:   0        1         2           3          4
    entry:  events a  events b  resync a   events a   remove b     ◀── appended here
              ▲                               ▲
           first kept                  a router's cursor (replays 3, 4 next)

Invariants:
  * offsets are consecutive from 0 for one ``epoch`` (a restarted directory has a new one);
  * at most ``max_entries`` entries and ``max_hashes`` hashes are kept; older ones are
    dropped, and a reader whose cursor fell behind ``first`` gets ``None`` and must take a
    snapshot (``PrefixIndex.snapshot``) instead.

Entries are plain tuples (cheap to pickle):
  ``("events", replica, seq_no, stored, removed, tier, closed)``,
  ``("resync", replica, seq_no, {tier: hashes}, closed)``, ``("remove", replica)``,
  ``("clear",)`` (``closed``: ``PrefixIndex.apply_batch``'s and ``resync``'s argument).
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LogRead:
    """Entries ``[start, next_cursor)`` of one epoch."""

    epoch: str
    start: int
    next_cursor: int
    entries: list


def entry_hashes(entry: tuple) -> int:
    """Number of block hashes an entry carries (its share of the log's memory bound)."""
    if entry[0] == "events":
        return len(entry[3]) + len(entry[4])
    if entry[0] == "resync":
        return sum(len(v) for v in entry[3].values())
    return 0


class EventLog:
    """Bounded append-only log with a per-instance epoch (see module doc)."""

    def __init__(self, max_entries: int = 16_384, max_hashes: int = 2_000_000) -> None:
        if max_entries < 1 or max_hashes < 1:
            raise ValueError("max_entries and max_hashes must be >= 1")
        self.epoch = uuid.uuid4().hex
        self.max_entries, self.max_hashes = max_entries, max_hashes
        self._entries: deque = deque()
        self._first = 0                 # offset of _entries[0]
        self._hashes = 0

    @property
    def end(self) -> int:
        """Offset the next appended entry gets (a fresh reader's cursor after a snapshot)."""
        return self._first + len(self._entries)

    @property
    def first(self) -> int:
        return self._first

    def append(self, entry: tuple) -> int:
        """Append one entry; returns its offset. Drops the oldest entries over the bounds."""
        self._entries.append(entry)
        self._hashes += entry_hashes(entry)
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries
                                          or self._hashes > self.max_hashes):
            self._hashes -= entry_hashes(self._entries.popleft())
            self._first += 1
        return self.end - 1

    def read(self, epoch: str | None, cursor: int, max_entries: int = 1024) -> LogRead | None:
        """Entries from ``cursor`` on (at most ``max_entries``), or None when the reader must
        take a snapshot: another epoch, or ``cursor`` outside ``[first, end]``."""
        if epoch != self.epoch or not self._first <= cursor <= self.end:
            return None
        start = cursor - self._first
        stop = min(len(self._entries), start + max_entries)
        entries = [self._entries[i] for i in range(start, stop)]
        return LogRead(self.epoch, cursor, cursor + len(entries), entries)

    def stats(self) -> dict:
        return {"log_first": self._first, "log_end": self.end, "log_hashes": self._hashes}
