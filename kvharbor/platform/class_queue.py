"""Cluster-wide in-flight count per QoS class: the gateway's load shedding (``max_queue``).

The engine schedules higher-priority classes first, so a new request of class C waits
behind every in-flight request whose class has priority >= C's. ``ClassQueue.enter``
refuses it when that number is already C's ``max_queue``: lower classes shed first under
overload, and premium traffic is never refused because of standard or batch traffic.

One named actor serves all gateway replicas (a per-replica count would let N gateway
replicas admit N x ``max_queue``). ``ClassQueue`` is the plain class; ``ClassQueueActor``
its ``@ray.remote`` wrapper. Invariant: ``counts[c]`` = places held for class c, >= 0.

Each place is held under a lease (``kvharbor.tenants.leases``): the gateway renews the places
of its live requests; a gateway replica that dies mid-request stops renewing, and its places
are given back within ``lease_s``. The actor restarts when it dies (``max_restarts=-1``) with
empty counts: requests in flight then are not counted until they end (the limit loosens
briefly), and their ``leave`` and renewals are no-ops, so counts never go below what is held.

The actor runs calls one at a time in the order they arrive, not in each caller's submission
order (``allow_out_of_order_execution``): no call needs an earlier one of the same gateway to
run first (a ``leave`` is sent after its ``enter`` answered), and an ordered actor holds back
all of a gateway's later calls, up to 30 s, behind one that never arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from kvharbor.tenants.leases import DEFAULT_LEASE_S, LeaseTable
from kvharbor.tenants.limits import GRANT_SHARE

DEFAULT_NAME = "kvharbor-class-queue"


@dataclass(slots=True)
class ClassQueue:
    """In-flight requests per QoS class name."""

    counts: dict[str, int] = field(default_factory=dict)
    leases: LeaseTable = field(default_factory=LeaseTable)
    grants: dict[str, dict[str, int]] = field(default_factory=dict)   # holder -> qos -> places
    holders: LeaseTable | None = None                                  # holder leases
    idle: dict[tuple[str, str], int] = field(default_factory=dict)    # (holder, qos) -> free, last sync
    answered: dict[str, tuple[int, list]] = field(default_factory=dict)  # holder -> (seq, answers)
    recall: set[tuple[str, str]] = field(default_factory=set)          # idle places to call back

    def __post_init__(self) -> None:
        if self.holders is None:
            self.holders = LeaseTable(self.leases.lease_s)

    def enter(self, qos: str, priorities: dict[str, int], limit: int,
              lease_id: str | None = None, now: float | None = None) -> int | None:
        """Count one request of ``qos`` in; None when admitted, else how many are ahead.

        Args:
            qos: the request's class.
            priorities: class name -> priority (higher = scheduled first), current config.
            limit: the class's ``max_queue``.
            lease_id: hold the place under this lease (None: no lease, held until ``leave``).
        """
        self.expire(now)
        mine = priorities[qos]
        ahead = sum(n for name, n in self.counts.items()
                    if name in priorities and priorities[name] >= mine)
        # Places of higher classes that their gateways held idle at the last sync are not in
        # flight: they do not shed this class (their own class still counts them; see
        # enter_or_recall). Approximate for the lower class, by what was used since that sync.
        ahead -= sum(free for name, free in self._idle_by_class().items()
                     if name in priorities and priorities[name] > mine)
        if ahead >= limit:
            return ahead
        self.counts[qos] = self.counts.get(qos, 0) + 1
        if lease_id is not None:
            self.leases.add(lease_id, qos, now)
        return None

    def enter_or_recall(self, qos: str, priorities: dict[str, int], limit: int,
                        lease_id: str | None = None, now: float | None = None) -> tuple[int | None, bool]:
        """``enter``, and on a refusal call back the places gateways hold idle in this class, if
        without them it would have been admitted (their next sync gives them back).
        ``(ahead, recalled)``: ``recalled`` True means a retry after the gateways' next sync
        may be admitted."""
        ahead = self.enter(qos, priorities, limit, lease_id, now)
        if ahead is None:
            return None, False
        called = {key: free for key, free in self.idle.items() if free > 0 and key[1] == qos}
        if ahead - sum(called.values()) >= limit:    # full even without them: nothing to recall
            return ahead, False
        self.recall |= set(called)
        return ahead, bool(called)

    def leave(self, qos: str, lease_id: str | None = None) -> None:
        """Count one request of ``qos`` out (it finished, failed or was refused later).

        With ``lease_id``: only if that lease is still held (not expired, not forgotten).
        """
        if lease_id is not None and self.leases.pop(lease_id) is None:
            return
        self.counts[qos] = max(0, self.counts.get(qos, 0) - 1)

    def renew(self, lease_ids: list[str], now: float | None = None) -> list[str]:
        """Extend these leases; returns the ids no longer held."""
        self.expire(now)
        return self.leases.renew(lease_ids, now)

    def expire(self, now: float | None = None) -> int:
        """Give back the places whose lease ran out (and a dead gateway's grants); returns how many."""
        gone = self.leases.expire(now)
        for qos in gone:
            self.counts[qos] = max(0, self.counts.get(qos, 0) - 1)
        for holder in self.holders.expire(now):
            self.answered.pop(holder, None)
            for qos, places in self.grants.pop(holder, {}).items():
                self.counts[qos] = max(0, self.counts.get(qos, 0) - places)
                self.idle.pop((holder, qos), None)
                self.recall.discard((holder, qos))
                gone.append(qos)
        return len(gone)

    def sync_places(self, holder: str, priorities: dict[str, int],
                    reports: list[tuple[str, int, int, int, bool, int]], seq: int = 0,
                    now: float | None = None) -> list[tuple[str, int, bool, bool]]:
        """Settle and top up a gateway's granted places; renews its lease.

        Each report is ``(qos, max_queue, back, want, held, free)``: ``back`` free places given
        back, ``want`` more asked for, ``held`` whether the gateway believes it holds a grant,
        ``free`` how many it keeps idle. Each answer is ``(qos, added, known, recall)``;
        ``known`` False: no grant was held here (restart or expiry), so the gateway's free
        places are void; ``recall`` True: another gateway was refused while these were idle, so
        give every free place back now. Granted places count as in flight, so ``max_queue``
        holds across gateways; a grant is at most 1/GRANT_SHARE of the room left. A sync sent
        again with the same ``seq`` (its answer was lost) gets that answer, applied once.
        """
        self.expire(now)
        done = self.answered.get(holder)
        if seq and done is not None and done[0] == seq:
            return done[1]
        self.holders.add(holder, holder, now)
        mine = self.grants.setdefault(holder, {})
        answers = []
        for qos, limit, back, want, held, free in reports:
            recall = (holder, qos) in self.recall
            self.recall.discard((holder, qos))
            if qos not in mine and held:
                self.idle.pop((holder, qos), None)
                answers.append((qos, 0, False, False))
                continue
            back = min(back, mine.get(qos, 0))
            self.counts[qos] = max(0, self.counts.get(qos, 0) - back)
            own = priorities.get(qos)
            room = 0 if own is None else limit - sum(
                n for name, n in self.counts.items() if name in priorities and priorities[name] >= own)
            added = 0 if recall else max(0, min(want, room // GRANT_SHARE))
            self.counts[qos] = self.counts.get(qos, 0) + added
            places = mine.get(qos, 0) - back + added
            self.idle[(holder, qos)] = free + added
            if places:
                mine[qos] = places
            else:
                mine.pop(qos, None)
                self.idle.pop((holder, qos), None)
            answers.append((qos, added, True, recall))
        if mine:
            self.answered[holder] = (seq, answers)
        else:
            del self.grants[holder]
            self.answered.pop(holder, None)
            self.holders.pop(holder)
        return answers

    def snapshot(self) -> dict[str, int]:
        """Places taken per class: requests in flight and places held in gateways' grants."""
        return dict(self.counts)

    def status(self) -> dict[str, dict[str, int]]:
        """What an operator reads: ``in_flight`` requests per class (places taken less those
        the gateways reported idle in their grants at their last sync; approximate by what a
        grant admitted since) and those ``granted_idle`` places."""
        idle = self._idle_by_class()
        return {"in_flight": {q: max(0, n - idle.get(q, 0)) for q, n in self.counts.items()},
                "granted_idle": {q: n for q, n in idle.items() if n}}

    def _idle_by_class(self) -> dict[str, int]:
        """Places the gateways held idle at their last sync, summed per class."""
        idle: dict[str, int] = {}
        for (_, qos), free in self.idle.items():
            idle[qos] = idle.get(qos, 0) + free
        return idle


@ray.remote(num_cpus=0, max_restarts=-1, allow_out_of_order_execution=True)
class ClassQueueActor:
    """The cluster's one ``ClassQueue`` (methods run one at a time, so no lock)."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        self._queue = ClassQueue(leases=LeaseTable(lease_s))

    def enter(self, qos: str, priorities: dict[str, int], limit: int,
              lease_id: str | None = None) -> int | None:
        return self._queue.enter(qos, priorities, limit, lease_id)

    def leave(self, qos: str, lease_id: str | None = None) -> None:
        self._queue.leave(qos, lease_id)

    def renew(self, lease_ids: list[str]) -> list[str]:
        return self._queue.renew(lease_ids)

    def snapshot(self) -> dict[str, int]:
        self._queue.expire()
        return self._queue.snapshot()

    def status(self) -> dict[str, dict[str, int]]:
        self._queue.expire()
        return self._queue.status()

    def enter_or_recall(self, qos: str, priorities: dict[str, int], limit: int,
                        lease_id: str | None = None) -> tuple[int | None, bool]:
        return self._queue.enter_or_recall(qos, priorities, limit, lease_id)

    def sync_places(self, holder: str, priorities: dict[str, int],
                    reports: list[tuple[str, int, int, int, bool, int]],
                    seq: int = 0) -> list[tuple[str, int, bool, bool]]:
        return self._queue.sync_places(holder, priorities, reports, seq)


def get_or_create_class_queue(name: str = DEFAULT_NAME, namespace: str = "kvharbor"):
    """The named actor, created on first use (detached: it outlives gateway replicas)."""
    return ClassQueueActor.options(name=name, namespace=namespace, lifetime="detached",
                                   get_if_exists=True).remote()
