"""Per-tenant fairness inside a QoS class: virtual token counters.

Each (class, tenant) has a counter of tokens it was served; among waiting requests of one
class, the tenant with the smallest counter goes first. A tenant is *active* while it has an
unfinished request. Each class also has a *virtual time*: the smallest counter among its
active tenants, remembered (never decreasing) while the class is idle. Whenever a tenant
becomes active (first time or again after a pause) its counter is raised to the class's
virtual time, so idling earns no credit: a tenant that went quiet cannot come back far
behind and monopolize the class, even if every tenant of the class was idle meanwhile::

    t=0   a: 0    b: 0          both active
    t=1   a: 900  b: 40         b goes quiet at 40
    t=2   a: 5000               b comes back: b = max(40, vtime = min(active) = 5000) = 5000
"""

from __future__ import annotations

from .request import Request


class FairShare:
    """Virtual token counters per (QoS class, tenant). O(active tenants of a class) per arrival
    of an idle tenant, O(1) otherwise."""

    def __init__(self) -> None:
        self.vtokens: dict[tuple[str, str], float] = {}
        self.active: dict[tuple[str, str], int] = {}     # unfinished requests per (class, tenant)
        self.vtime: dict[str, float] = {}                 # per class, see module doc

    def arrive(self, req: Request) -> None:
        """A request joined the queue; if its tenant was idle, start it at the class minimum."""
        k = (req.qos, req.tenant)
        n = self.active.get(k, 0)
        self.active[k] = n + 1
        if n:
            return
        floor = self._class_time(req.qos, exclude=k)
        self.vtokens[k] = max(self.vtokens.get(k, 0.0), floor)

    def leave(self, req: Request) -> None:
        """A request finished or was aborted."""
        k = (req.qos, req.tenant)
        n = self.active.get(k, 0) - 1
        if n > 0:
            self.active[k] = n
            return
        self._class_time(req.qos)             # remember the class's time as k leaves
        self.active.pop(k, None)

    def _class_time(self, qos: str, exclude: tuple[str, str] | None = None) -> float:
        """Advance and return the class's virtual time: min counter of its active tenants."""
        active = [self.vtokens[o] for o in self.active if o[0] == qos and o != exclude]
        now = max(self.vtime.get(qos, 0.0), min(active, default=0.0))
        self.vtime[qos] = now
        return now

    def key(self, req: Request) -> float:
        return self.vtokens.get((req.qos, req.tenant), 0.0)

    def charge(self, req: Request, tokens: int) -> None:
        self.vtokens[(req.qos, req.tenant)] = self.key(req) + tokens
