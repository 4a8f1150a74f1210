"""Preemption policy: which running request to preempt, and swap or recompute it.

Both choices rest on one estimate, the *lost work* of a victim: its computed tokens that are
not in leading blocks another holder keeps on the device (``ref_cnt > 1``: shared with a
running request or a pinned prefix). Those would be prefix hits on recompute; everything else
is likely evicted under the memory pressure that caused the preemption::

    victim blocks  [b3 r2][b8 r2][b1 r1][b6 r1][b2 r1 partial]     computed = 75, bs = 16
                   |<- shared: hit ->|<------- lost: 75 - 32 = 43 ------->|

Victim order (within what the QoS rules allow): lowest priority first; among equal
priority, the least lost work; then the latest arrival. Mode ``swap`` always tries to swap;
``auto`` swaps when the lost work is at least ``min_swap_blocks`` blocks and more than half
of the computed tokens. A swap that finds no host room falls back to recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .request import Request

MODES = ("recompute", "swap", "auto")


@dataclass(slots=True)
class PreemptionPolicy:
    """Strategy object the scheduler asks about victims (see module doc)."""

    mode: str = "recompute"
    block_size: int = 16
    min_swap_blocks: int = 2

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"preemption_mode must be one of {MODES}, got {self.mode!r}")

    def lost_tokens(self, req: Request) -> int:
        """Computed tokens of ``req`` not in leading blocks that stay on the device."""
        kept = 0
        for block in req.blocks[:req.num_computed_tokens // self.block_size]:
            if block.ref_cnt <= 1:
                break
            kept += 1
        return req.num_computed_tokens - kept * self.block_size

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """The candidate to preempt first (lowest priority, least lost work, latest arrival)."""
        return min(candidates, key=lambda r: (r.priority, self.lost_tokens(r), -r.arrival_seq))

    def should_swap(self, req: Request) -> bool:
        """Whether to try swapping ``req`` to host memory instead of recomputing it later."""
        if self.mode != "auto":
            return self.mode == "swap"
        lost = self.lost_tokens(req)
        return lost >= self.min_swap_blocks * self.block_size and 2 * lost > req.num_computed_tokens
