"""Leases: what a gateway holds in a shared actor expires unless the gateway renews it.

A gateway replica that dies mid-request never releases its admission ticket or its class-queue
place. So each one is held under a lease of ``lease_s`` seconds: the holder renews all of its
live leases every ``lease_s / 3`` seconds (:class:`LeaseKeeper`), and the actor drops a lease
that went ``lease_s`` without renewal, giving back what it held (:meth:`LeaseTable.expire`).
A slot held by a dead gateway is therefore back within ``lease_s`` (plus one sweep, which
runs on every call the actor gets).

Releasing a lease that already expired (or that an actor restart forgot) is a no-op: counts
never go below what is really held. Times are ``time.time()`` seconds.

::

    table.add("t1", payload, now=0)      renew(["t1"], now=3) -> []   (t1 now expires at 13)
    expire(now=12.9) -> []               expire(now=13.1) -> [payload]
    pop("t1") -> None                    (expired already: the caller undoes nothing twice)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvharbor.actors.calls import start_background

DEFAULT_LEASE_S = 10.0
logger = logging.getLogger("kvharbor.leases")


class LeaseTable:
    """Lease id -> (expiry, payload). Not thread-safe (actors run one call at a time)."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.lease_s = lease_s
        self._leases: dict[str, tuple[float, Any]] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, lease_id: str, payload: Any, now: float | None = None) -> None:
        self._leases[lease_id] = (_now(now) + self.lease_s, payload)

    def renew(self, lease_ids: list[str], now: float | None = None) -> list[str]:
        """Extend these leases; returns the ids this table does not hold (expired or gone)."""
        until, unknown = _now(now) + self.lease_s, []
        for lease_id in lease_ids:
            held = self._leases.get(lease_id)
            if held is None:
                unknown.append(lease_id)
            else:
                self._leases[lease_id] = (until, held[1])
        return unknown

    def pop(self, lease_id: str) -> Any | None:
        """The payload of a lease given back now, or None if it expired or was never held."""
        held = self._leases.pop(lease_id, None)
        return None if held is None else held[1]

    def expire(self, now: float | None = None) -> list[Any]:
        """Drop every lease past its expiry; returns their payloads (the caller undoes them)."""
        now = _now(now)
        gone = [lease_id for lease_id, (until, _) in self._leases.items() if until <= now]
        return [self._leases.pop(lease_id)[1] for lease_id in gone]


def _now(now: float | None) -> float:
    return time.time() if now is None else now


class LeaseKeeper:
    """The holder's side: the lease ids it holds, renewed together every ``period_s``.

    ``renew(ids)`` is an async callable (an actor call) returning the ids the actor no longer
    holds; those are forgotten here (their slot is already back). A failing renewal is logged
    and tried again next period: the lease only runs out if renewals fail for ``lease_s``.
    """

    def __init__(self, renew: Callable[[list[str]], Awaitable[list[str]]], period_s: float,
                 timeout_s: float = 5.0) -> None:
        self._renew, self.period_s, self.timeout_s = renew, period_s, timeout_s
        self.held: set[str] = set()
        self._task: asyncio.Task | None = None

    def hold(self, lease_id: str) -> None:
        self.held.add(lease_id)
        if self._task is None or self._task.done():
            self._task = start_background(self._run())

    def drop(self, lease_id: str) -> None:
        self.held.discard(lease_id)

    async def renew_now(self) -> None:
        if not self.held:
            return
        ids = sorted(self.held)
        try:
            unknown = await asyncio.wait_for(self._renew(ids), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - retried next period
            logger.warning("lease renewal of %d leases failed: %r", len(ids), exc)
            return
        for lease_id in unknown or ():
            self.held.discard(lease_id)

    async def _run(self) -> None:
        while self.held:
            await asyncio.sleep(self.period_s)
            await self.renew_now()
