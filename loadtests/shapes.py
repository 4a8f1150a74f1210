"""Load shapes as pure functions of time: how many simulated users run at ``t`` seconds.

No Locust import here (Locust monkey-patches the process when imported); the locustfile wraps
:func:`users_at` in a ``LoadTestShape``. ``users`` is the capacity-level user count ``N``::

    steady    N ─────────────────────────────          constant
    ramp      1 ╱╱╱╱╱╱╱╱╱╱╱╱╱╱╱╱╱╱╱╱╱╱╱╱─────── N     linear over 80 %, then hold
    overload  N ──────┐2N───────────────┐N──────      step to 2x capacity for the middle half,
                      └─────────────────┘             then back (recovery)

The open loop (``rate_at``) follows the same profiles with an arrival rate instead of a user
count: Poisson arrivals at ``rate`` requests/s (steady), rising to it (ramp), or at ``2 * rate``
in the middle half (overload). Arrivals do not wait for answers, so a slow server builds a
queue instead of slowing the load down (closed loops hide overload that way).

With the user weights of the locustfile (premium 1 : standard 2 : batch 2), N = 5 gives one
premium user in five: 20 % of users, at 1x and at 2x.
Every function returns None once ``t >= duration_s``: the test stops.
"""

from __future__ import annotations

import math

SHAPES = ("steady", "ramp", "overload")


def _progress(shape: str, t: float, duration_s: float) -> float | None:
    """Fraction of the test done at ``t`` (None once it is over); refuses unknown shapes."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    return None if t >= duration_s else t / duration_s


def _overload(frac: float) -> float:
    """The overload shape's multiplier: 2x in the middle half of the test."""
    return 2.0 if 0.25 <= frac < 0.75 else 1.0


def users_at(shape: str, t: float, duration_s: float, users: int) -> int | None:
    """Target user count at ``t`` seconds into a test of ``duration_s`` (None: stop)."""
    if users < 1:
        raise ValueError(f"users must be >= 1, got {users}")
    frac = _progress(shape, t, duration_s)
    if frac is None or shape == "steady":
        return None if frac is None else users
    if shape == "ramp":
        return max(1, min(users, 1 + math.floor((users - 1) * frac / 0.8 + 1e-9)))
    return int(users * _overload(frac))


def rate_at(shape: str, t: float, duration_s: float, rate: float) -> float | None:
    """Open-loop arrival rate (requests/s) at ``t`` seconds (None: stop)."""
    if rate <= 0:
        raise ValueError(f"arrival rate must be > 0 requests/s, got {rate}")
    frac = _progress(shape, t, duration_s)
    if frac is None or shape == "steady":
        return None if frac is None else rate
    if shape == "ramp":
        return rate * max(0.05, min(1.0, frac / 0.8))
    return rate * _overload(frac)


def parse_duration(text: str | float | int) -> float:
    """'90', '90s', '2m', '1h30m' -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    total, number = 0.0, ""
    units = {"h": 3600, "m": 60, "s": 1}
    for ch in text.strip().lower():
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in units and number:
            total += float(number) * units[ch]
            number = ""
        else:
            raise ValueError(f"bad duration {text!r}: use e.g. 60, 60s, 2m or 1h30m")
    return total + (float(number) if number else 0.0)
