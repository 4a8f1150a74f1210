"""Latency-budgeted steps: a learned step-cost model and the per-step time budget.

A premium arrival waits for the step in progress, then runs in the next one, so while a
higher class is about, every step is kept under that class's *step target* (milliseconds;
half its ``ttft_slo_ms``, or ``step_target_ms`` when set). Lower classes' prefill tokens and
decodes are trimmed so the step's estimated duration fits (see ``StepBudget``); the higher
class's own work is never trimmed (it may overshoot alone), and lower classes always get a
minimum share of every step, so they never starve.

Cost model (seconds)::

    est(tokens, seqs) = a + b * tokens + c * seqs        a, b, c >= 0

learned online from measured steps by exponentially weighted least squares (forgetting
factor ``decay`` per step, a ridge pull toward the prior so that it is defined from the first
step). A step's duration is measured by the scheduler as the time from one ``schedule()``
call to the next while the engine steps back to back (the driver's own work between steps
counts: an arrival waits for it too); gaps after an empty step or longer than ``max_gap_s``
(the engine went idle) are not samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR = (0.004, 0.00005, 0.0003)        # a [s], b [s/token], c [s/seq]: a small CPU model


def _solve3(m: list[list[float]], v: list[float]) -> list[float]:
    """Solve the 3x3 system ``m x = v`` (Gaussian elimination with partial pivoting)."""
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        if abs(a[col][col]) < 1e-18:
            return list(PRIOR)
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for k in range(col, 4):
                a[r][k] -= f * a[col][k]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][k] * x[k] for k in range(r + 1, 3))) / a[r][r]
    return x


@dataclass(slots=True)
class StepCostModel:
    """``est(tokens, seqs)`` in seconds, learned online (see module doc)."""

    decay: float = 0.98
    ridge: float = 1.0
    coef: list[float] = field(default_factory=lambda: list(PRIOR))
    samples: int = 0
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xy: list[float] = field(default_factory=lambda: [0.0] * 3)

    def estimate(self, tokens: int, seqs: int) -> float:
        a, b, c = self.coef
        return a + b * tokens + c * seqs

    def observe(self, tokens: int, seqs: int, seconds: float) -> None:
        """Add one measured step and refit."""
        x = (1.0, float(tokens), float(seqs))
        for i in range(3):
            self._xy[i] = self.decay * self._xy[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = self.decay * self._xx[i][j] + x[i] * x[j]
        self.samples += 1
        # Ridge toward the prior, scaled per feature so each pull is comparable.
        scale = (1.0, 1e2, 1e1)                 # a typical step: 100 tokens, 10 seqs
        m = [[self._xx[i][j] + (self.ridge * scale[i] ** 2 if i == j else 0.0) for j in range(3)]
             for i in range(3)]
        v = [self._xy[i] + self.ridge * scale[i] ** 2 * PRIOR[i] for i in range(3)]
        self.coef = [max(0.0, x) for x in _solve3(m, v)]


def in_prefill(req, computed: int) -> bool:
    """True while part of ``req``'s prompt (or, after preemption, of its output) is not
    computed, with ``computed`` tokens done."""
    return req.num_tokens - computed > 1


MIN_PROGRESS_TOKENS = 16      # a trimmed class always gets this much per step (no starvation)


@dataclass(slots=True)
class StepBudget:
    """What one step may still add for trimmed (lower) classes.

    The per-step overhead ``a`` is paid whatever is trimmed, so the target bounds the
    *variable* cost ``b * tokens + c * seqs`` of the whole step to ``max(target - a, target / 2)``
    (on a slow, contended machine ``a`` alone may exceed the target). The first trimmed item of
    a step always gets at least ``MIN_PROGRESS_TOKENS`` (a decode, or a prefill chunk), so lower
    classes progress however long premium traffic lasts.

    A step in which a top-class request computes prompt tokens (its time to first token is
    this step) gives lower classes only that minimum share.

    ``target_s`` None: no time limit (only the token budget and the prefill cap apply).
    """

    model: StepCostModel
    target_s: float | None
    tokens: int = 0
    seqs: int = 0
    trimmed_seqs: int = 0           # items of trimmed classes scheduled in this step
    first_token: bool = False       # a top-class request computes its first token in this step

    def add(self, tokens: int, trimmed: bool, prefill: bool = False) -> None:
        self.tokens += tokens
        self.seqs += 1
        self.trimmed_seqs += trimmed
        self.first_token = self.first_token or (prefill and not trimmed)

    def room(self, num_new: int) -> int:
        """Most of ``num_new`` tokens (one more sequence) a trimmed request may add (0: none)."""
        if self.target_s is None:
            return num_new
        a, b, c = self.model.coef
        variable = max(self.target_s - a, self.target_s / 2)
        # A top-class prefill's time to first token is this step: it runs with only the
        # minimum share of lower classes, not with a whole target's worth of their work.
        spare = -1.0 if self.first_token else variable - b * self.tokens - c * (self.seqs + 1)
        fits = num_new if b <= 0 else max(0, min(num_new, int(spare / b))) if spare > 0 else 0
        if self.trimmed_seqs == 0:
            fits = max(fits, min(num_new, MIN_PROGRESS_TOKENS))
        return fits


class StepInterrupted(Exception):
    """The step in flight was cut short for a higher-class arrival (nothing of it is kept)."""


NO_PRIORITY = float("-inf")


class StepInterrupt:
    """Lets a latency-budgeted arrival cut short the step in flight instead of waiting for it.

    The step budget bounds how long a step runs while a higher class is about, but a premium
    request arriving mid-step still waits for the rest of it. So another thread (the replica's
    event loop) ``announce``s the priority of each request it queues for the engine, and the
    forward calls ``check(layer)`` before each layer's attention, and ``check(layer, True)``
    before its MLP where the forward is kvharbor's own (``fast_model``): the step is abandoned
    (``StepInterrupted``) when an announced priority

    - belongs to the highest class with a step target (``interruptible``, set by the engine:
      premium in tenants.yaml), and
    - is above the step's *protected* priority: the highest class whose prompt tokens the step
      computes (a first token already on its way is not thrown away for a peer), and the
      lowest class in the step (a step holding only that class's work is not cut for it).

    An abandoned step keeps nothing: the engine advances ``num_computed_tokens`` and caches
    blocks only after a forward returns, and the K/V the cut forward wrote went only to the
    requests' own uncomputed slots, which the next step computes again. Its cost is the work
    done so far, so a step is only cut in its first ``fraction`` of half-layers (attention,
    MLP; ``cutoff`` counts them): with 0.75 a cut never throws away more than three times the
    wait it saves. (On the builtin 4-layer model, qos_engine seed 0 at 2x load, two rounds:
    premium p99 TTFT 19.3 / 20.7 ms cutting before 3 of 4 layers, 16.3 / 22.5 ms before all 4,
    43.3 / 50.2 ms never; throughput the same within noise. Checking before attention only, the
    last chance to cut came before the third layer's attention, so an arrival just after it
    waited for half the step's layers; the check before the MLP moves that to before the
    third layer's MLP.)

    Protocol: the consumer calls ``clear()`` *before* it drains the queue the announcements
    refer to (an announcement made after the drain then survives for the next step).
    Announcements are plain attribute writes, atomic under the GIL, read once per layer.
    """

    __slots__ = ("announced", "protected", "cutoff", "interruptible", "num_interrupted")

    def __init__(self, num_layers: int, fraction: float = 0.75) -> None:
        self.announced = NO_PRIORITY
        self.protected = float("inf")           # no step armed: nothing to cut
        self.cutoff = max(1, int(2 * num_layers * fraction))    # in half-layers
        self.interruptible: frozenset = frozenset()   # priorities that may cut a step
        self.num_interrupted = 0

    def announce(self, priority: float) -> None:
        """A request of ``priority`` was queued (any thread)."""
        if priority in self.interruptible and priority > self.announced:
            self.announced = priority

    def clear(self) -> None:
        """The queue is about to be drained into the engine (the consumer's thread)."""
        self.announced = NO_PRIORITY

    def arm(self, items) -> None:
        """The step ``items`` (``ScheduledRequest``s) is about to run."""
        prefill = [s.request.priority for s in items        # computing prompt tokens
                   if in_prefill(s.request, s.request.num_computed_tokens)]
        lowest = min((s.request.priority for s in items), default=float("inf"))
        self.protected = max(max(prefill, default=NO_PRIORITY), lowest)

    def disarm(self) -> None:
        self.protected = float("inf")

    def check(self, layer: int, before_mlp: bool = False) -> None:
        """Raise ``StepInterrupted`` when the step in flight should yield (see class doc);
        called before ``layer``'s attention, or before its MLP (``before_mlp``)."""
        if self.announced > self.protected and 2 * layer + before_mlp < self.cutoff:
            self.num_interrupted += 1
            raise StepInterrupted(layer)
