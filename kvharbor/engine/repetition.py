"""vLLM's ``repetition_detection``: end an output that has fallen into a loop.

A small or confused model may repeat a pattern (``abcdabcdabcd...``) until ``max_tokens``. With
``SamplingParams(repetition_detection={"max_pattern_size": 8, "min_count": 4})`` the engine ends
the output as soon as its last tokens are one pattern of ``min_pattern_size`` to
``max_pattern_size`` tokens repeated ``min_count`` times in a row: ``finish_reason``
``"repetition"``, ``stop_reason`` ``"repetition_detected"`` (vLLM's names). Checked once
``min_tokens`` are out, after the stop tokens and the length limit (which win when they apply
to the same token); the text keeps the repetitions.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

REASON = "repetition_detected"


@dataclass(slots=True, frozen=True)
class RepetitionDetectionParams:
    max_pattern_size: int = 0
    """Longest pattern looked for, in tokens (0: off)."""
    min_pattern_size: int = 0
    """Shortest pattern looked for (0: 1)."""
    min_count: int = 0
    """How many times in a row a pattern must occur (at least 2 when on)."""

    @classmethod
    def of(cls, spec) -> RepetitionDetectionParams | None:
        """``spec`` (these params or a dict of their fields) checked; None when it is off."""
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - set(cls.__slots__))
            if unknown:
                raise ValueError(f"repetition_detection has no field {unknown[0]!r} (its fields: "
                                 "max_pattern_size, min_pattern_size, min_count)")
            spec = cls(**spec)
        if not isinstance(spec, cls):
            raise ValueError(f"repetition_detection must be a RepetitionDetectionParams or a dict, got {spec!r}")
        try:
            high, low, count = (operator.index(v) for v in (spec.max_pattern_size, spec.min_pattern_size,
                                                            spec.min_count))
        except TypeError:
            raise ValueError(f"repetition_detection's fields are integers, got {spec!r}") from None
        if high < 0 or low < 0 or low > high:
            raise ValueError("repetition_detection: max_pattern_size and min_pattern_size must be >= 0, with "
                             "min_pattern_size <= max_pattern_size (both 0: off)")
        if high > 0 and count < 2:
            raise ValueError("repetition_detection: min_count must be >= 2 (the times a pattern repeats)")
        return cls(high, low, count) if high > 0 else None

    def found(self, ids: list[int], within: int | None = None) -> bool:
        """Whether ``ids`` end with a pattern of a size in range repeated ``min_count`` times,
        all of it in their last ``within`` ids (default: all; e.g. the output of prompt + output)."""
        within = len(ids) if within is None else within
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            span = size * self.min_count
            if span > within:
                break
            tail = ids[-size:]
            if all(ids[-span + k * size:len(ids) - span + (k + 1) * size] == tail for k in range(self.min_count - 1)):
                return True
        return False
