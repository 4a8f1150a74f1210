"""OpenAI's ``service_tier`` on kvharbor's QoS classes: a request may run below its tenant's
class, never above it.

``service_tier: "flex"`` (OpenAI's flex processing: slower, for work that can wait) runs the
request at the lowest-priority QoS class of ``tenants.yaml`` (by ``priority``) when that class
is below the tenant's own: its queue place, overload shedding, engine priority, preemption,
pinned-region access and metrics are that class's; the tenant's limits stay the tenant's. A
tenant already in the lowest class runs there anyway. ``auto``, ``default`` and null run at
the tenant's class (OpenAI's ``priority`` tier is not offered: a key's class is its highest).
The Batch API sends its lines as ``flex`` unless a line names a tier itself.

A flex request of a pinned class's tenant is refused on the premium lane (403): the lane
serves pinned classes only, and flex is not one.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvharbor.platform.error_body import APIError

ServiceTier = Literal["auto", "default", "flex"]
FLEX = "flex"
DOC = ("\"flex\": run at the lowest-priority QoS class (yields to every other request; the tenant's limits still "
       "apply) when it is below the key's class; \"auto\", \"default\" or null: the key's class. No \"priority\": a "
       "key's class is the highest it gets.")


def lowest_class(classes: dict) -> str:
    """The name of the lowest-priority class (ties: the first name in sort order)."""
    return min(classes, key=lambda name: (classes[name].priority, name))


def tiered(principal, tier: str | None, classes: dict, lane: bool = False):
    """The principal a request of ``tier`` runs as (``principal`` itself unless it is lowered).

    Raises:
        APIError: 403 for a lowered request on the premium lane (``lane``).
    """
    if tier != FLEX:
        return principal
    name = lowest_class(classes)
    if classes[name].priority >= principal.qos.priority:
        return principal
    if lane:
        raise APIError(403, f"service_tier \"flex\" runs at QoS class {name!r}, which the premium lane does not "
                       "serve (pinned classes only): send the request to the app's main port",
                       "wrong_endpoint", "service_tier")
    return dataclasses.replace(principal, qos_name=name, qos=classes[name])


def answered_tier(principal) -> str:
    """The ``service_tier`` a response reports: ``flex`` for a request lowered below its
    tenant's class, else ``default``."""
    return FLEX if principal.qos_name != principal.config.qos else "default"


__all__ = ["ServiceTier", "FLEX", "DOC", "lowest_class", "tiered", "answered_tier"]
