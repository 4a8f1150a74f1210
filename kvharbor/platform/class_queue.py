"""Cluster-wide in-flight count per QoS class: the gateway's load shedding (``max_queue``).

The engine schedules higher-priority classes first, so a new request of class C waits
behind every in-flight request whose class has priority >= C's. ``ClassQueue.enter``
refuses it when that number is already C's ``max_queue``: lower classes shed first under
overload, and premium traffic is never refused because of standard or batch traffic.

One named actor serves all gateway replicas (a per-replica count would let N gateway
replicas admit N x ``max_queue``): the admission actor holds the one ``ClassQueue``
(``kvharbor.tenants.admission_actor.GateKeeper``), so a request's queue place and its
admission are one call. Invariant: ``counts[c]`` = entered - left for class c, >= 0.
A gateway replica that dies mid-request leaves its requests counted (a known limitation).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ClassQueue:
    """In-flight requests per QoS class name."""

    counts: dict[str, int] = field(default_factory=dict)

    def enter(self, qos: str, priorities: dict[str, int], limit: int) -> int | None:
        """Count one request of ``qos`` in; None when admitted, else how many are ahead.

        Args:
            qos: the request's class.
            priorities: class name -> priority (higher = scheduled first), current config.
            limit: the class's ``max_queue``.
        """
        mine = priorities[qos]
        ahead = sum(n for name, n in self.counts.items()
                    if name in priorities and priorities[name] >= mine)
        if ahead >= limit:
            return ahead
        self.counts[qos] = self.counts.get(qos, 0) + 1
        return None

    def leave(self, qos: str) -> None:
        """Count one request of ``qos`` out (it finished, failed or was refused later)."""
        self.counts[qos] = max(0, self.counts.get(qos, 0) - 1)

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
