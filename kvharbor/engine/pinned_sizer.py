"""The pinned region sized by load: between a floor and a ceiling, following premium demand.

Demand is the number of distinct blocks pinned-class work holds (``BlockPool.
pinned_class_blocks``: the pinned region's used blocks, i.e. pinned prefixes and pinned-class
requests' and sessions' blocks, plus the shared blocks those requests borrowed), sampled every
step; a prefix block that several requests hit counts once. The target is the window's peak
demand with headroom, clamped::

    target = clamp(ceil(peak demand over window_s * headroom), floor, ceiling)

``floor`` is what tenants.yaml reserves (and ``pinned_kv_blocks``); ``ceiling`` None means a
fixed region of ``floor`` blocks. The pool moves only free blocks, so a resize may stop short;
the scheduler asks again every step until the region has its target size (growing as soon as
shared blocks free up). Shrinking waits ``shrink_after_s`` below target, so a region does not
give up blocks between two bursts.

The window peak is a monotonic deque: O(1) amortized per sample.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class PinnedSizer:
    """Target size of the pinned region (blocks)."""

    floor: int = 0
    ceiling: int | None = None
    window_s: float = 30.0
    headroom: float = 1.25
    shrink_after_s: float = 5.0
    _peaks: deque = field(default_factory=deque)      # (time, demand), demands decreasing
    _below_since: float | None = None

    def observe(self, demand: int, now: float) -> None:
        """One demand sample (blocks) at ``now`` (seconds, monotonic)."""
        while self._peaks and self._peaks[-1][1] <= demand:
            self._peaks.pop()
        self._peaks.append((now, demand))
        while self._peaks[0][0] < now - self.window_s:
            self._peaks.popleft()

    @property
    def peak(self) -> int:
        return self._peaks[0][1] if self._peaks else 0

    def target(self) -> int:
        """Blocks the region should have now (the floor when sizing by load is off)."""
        if self.ceiling is None:
            return self.floor
        want = math.ceil(self.peak * self.headroom)
        return max(self.floor, min(self.ceiling, want))

    def decide(self, size: int, now: float) -> int:
        """Size to resize to from ``size``: grow at once, shrink after ``shrink_after_s``."""
        target = self.target()
        if target >= size or target < self.floor or self.ceiling is None:
            self._below_since = None
            return target
        if self._below_since is None:
            self._below_since = now
        return target if now - self._below_since >= self.shrink_after_s else size
