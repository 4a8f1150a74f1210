"""Per-tenant fairness inside a QoS class: virtual token counters.

Each (class, tenant) has a counter of tokens it was served; among waiting requests of one
class, the tenant with the smallest counter goes first. A tenant is *active* while it has an
unfinished request. Whenever a tenant becomes active (first time or again after a pause) its
counter is raised to the smallest counter of the other active tenants of its class, so idling
earns no credit: a tenant that went quiet cannot come back far behind and monopolize the class::

    t=0   a: 0    b: 0          both active
    t=1   a: 900  b: 40         b goes quiet at 40
    t=2   a: 5000               b comes back: b = max(40, min(active) = 5000) = 5000
"""

from __future__ import annotations

from .request import Request


class FairShare:
    """Virtual token counters per (QoS class, tenant). O(active tenants of a class) per arrival
    of an idle tenant, O(1) otherwise."""

    def __init__(self) -> None:
        self.vtokens: dict[tuple[str, str], float] = {}
        self.active: dict[tuple[str, str], int] = {}     # unfinished requests per (class, tenant)

    def arrive(self, req: Request) -> None:
        """A request joined the queue; if its tenant was idle, start it at the class minimum."""
        k = (req.qos, req.tenant)
        n = self.active.get(k, 0)
        self.active[k] = n + 1
        if n:
            return
        floor = min((self.vtokens[o] for o in self.active if o[0] == req.qos and o != k),
                    default=None)
        own = self.vtokens.get(k)
        if floor is None:
            self.vtokens[k] = 0.0 if own is None else own
        else:
            self.vtokens[k] = floor if own is None else max(own, floor)

    def leave(self, req: Request) -> None:
        """A request finished or was aborted."""
        k = (req.qos, req.tenant)
        n = self.active.get(k, 0) - 1
        if n > 0:
            self.active[k] = n
        else:
            self.active.pop(k, None)

    def key(self, req: Request) -> float:
        return self.vtokens.get((req.qos, req.tenant), 0.0)

    def charge(self, req: Request, tokens: int) -> None:
        self.vtokens[(req.qos, req.tenant)] = self.key(req) + tokens
