"""Overload guard: a gateway sheds lower classes when its own event loop falls behind.

Every request costs the request path CPU before the engine sees it and while it streams
(HTTP parsing, actor calls, one event-loop turn per streamed chunk), and premium requests wait
in the same event loop as everyone else. Past what the hosts can carry, an unbounded backlog of
lower-class requests starves that loop: premium's first token then waits seconds at the
gateway even though the engine schedules it first, and the path's own work crowds out the
engines (throughput falls below what the app served at capacity).

The guard keeps the loop responsive with an adaptive concurrency limit (the idea of Envoy's
adaptive concurrency filter and Netflix's concurrency-limits), over the requests of
*non-pinned* classes in flight through this gateway:

    signal    event-loop lag: a tick every ``TICK_S`` that should wake on time; the median
              lag of a window of ``WINDOW_S``
    decrease  lag above target: limit = max(floor, min(limit, in flight) x ``BACKOFF``)
    increase  lag under target while in flight >= half the limit: limit += limit / 8
    relax     lag under target and in flight under half the limit for ``RELAX_WINDOWS``
              windows in a row: the limit is lifted (demand fell)
    shed      a request of class C is refused (429 ``overloaded``, Retry-After) when the
              non-pinned requests in flight here reach limit x priority(C) / top priority of
              the non-pinned classes, but never below ``MIN_LIMIT``: the lowest classes shed
              first, and no class is shut out

Pinned classes (premium) are never shed or counted here (their tenants' limits and queue
places bound them). The limit starts unbounded, so nothing is shed until the loop has lagged;
the check is one comparison, made with the API key check before the request body is read
(``Gateway._gate``), and again when the request is counted, before tokenization and before any
control-plane call: a shed request costs the gateway no body parsing and no call.
``lag_target_ms`` None turns the guard off. The tick runs only while non-pinned requests come
(it stops ``IDLE_STOP_S`` after the last one, with nothing in flight and no limit).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time

from kvharbor.actors.calls import start_background
from kvharbor.platform.error_body import APIError

TICK_S = 0.01
WINDOW_S = 0.25
BACKOFF = 0.8
GROWTH = 1 / 8
RELAX_WINDOWS = 8
"""Windows in a row with the loop on time and the limit far from binding (in flight under
half of it) after which the limit is lifted."""
MIN_LIMIT = 8
"""Any non-pinned class may have this many requests in flight at this gateway (counting all
non-pinned classes), however far the limit falls."""
IDLE_STOP_S = 10.0
"""The tick stops after this long without a request (nothing in flight, no limit); the next
request starts it again."""
SHED_HEADER = "X-KVHarbor-Shed"
"""On a 429 of the guard (value ``overloaded``): the request was shed for load, not refused for
its tenant's limits."""
DEFAULT_LAG_TARGET_MS = 10.0
"""A premium request crosses a handful of loop turns (handler, control flow, first chunk); at
10 ms each they stay within an idle premium request's time to first token."""


class OverloadGuard:
    """One per gateway replica (and one in Serve's proxy: ``proxy_guard``);
    ``enter``/``leave`` around each non-pinned request."""

    def __init__(self, lag_target_ms: float | None = DEFAULT_LAG_TARGET_MS,
                 min_limit: int = MIN_LIMIT, metrics=None, where: str = "gateway") -> None:
        self.where = where                   # "gateway" or "proxy" (its metrics' names)
        self.target_s = None if lag_target_ms is None else lag_target_ms / 1000.0
        self.min_limit = min_limit
        self.metrics = metrics
        self.limit = math.inf
        self.shed = 0
        self.last_lag_s = 0.0
        self._held: set[str] = set()        # non-pinned requests in flight here
        self._lags: list[float] = []
        self._quiet = 0
        self._last_request = 0.0
        self._classes: dict | None = None
        self._top = 1.0
        self._task: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return self.target_s is not None

    @property
    def in_flight(self) -> int:
        return len(self._held)

    # ---- requests ------------------------------------------------------------------------
    def share(self, qos, qos_classes: dict) -> float | None:
        """Class ``qos``'s share of the limit (priority / top non-pinned priority among
        ``qos_classes``, tenants.yaml's); None for a pinned class (never shed)."""
        return None if qos.pinned else qos.priority / self._top_priority(qos_classes)

    def check(self, qos, qos_classes: dict, tenant: str = "") -> None:
        """Raise the 429 if a request of ``tenant``, class ``qos``, would be shed now (counted
        in ``kvharbor_rate_limited``, not in flight: the gateway's key check calls this before
        the body is read)."""
        self.check_share(self.share(qos, qos_classes), tenant)

    def check_share(self, share: float | None, tenant: str = "") -> None:
        """``check`` for a class known by its ``share`` (None: pinned, never shed)."""
        if not self.enabled or share is None:
            return
        self._last_request = time.perf_counter()
        self._ensure_running()
        if self.limit == math.inf:       # not lagged yet (inf x a share of 0 would be NaN)
            return
        threshold = max(self.min_limit, self.limit * share)
        if self.in_flight >= threshold:
            raise self.refusal(f"{self.in_flight} requests of classes that are not pinned are in "
                               f"flight here and the limit for this QoS class is {threshold:.0f} now",
                               tenant)

    def refusal(self, why: str, tenant: str = "") -> APIError:
        """Count one request shed (``kvharbor_rate_limited{reason="overloaded"}``) and return
        its 429, which carries ``SHED_HEADER`` so that Serve's proxy (``proxy_guard``) can
        shed the class itself for a while."""
        self.shed += 1
        if self.metrics is not None:
            self.metrics.rate_limited(tenant, "overloaded")
        return APIError(429, f"the server is overloaded: {why}; retry later", "overloaded",
                        headers={"Retry-After": "1", SHED_HEADER: "overloaded"})

    def enter(self, rid: str, qos, qos_classes: dict, tenant: str = "") -> None:
        """Count ``rid`` (a request of ``tenant``, class ``qos`` among ``qos_classes``,
        tenants.yaml's) or raise the 429."""
        self.enter_share(rid, self.share(qos, qos_classes), tenant)

    def enter_share(self, rid, share: float | None, tenant: str = "") -> None:
        """``enter`` for a class known by its ``share`` (None: pinned, not counted)."""
        self.check_share(share, tenant)
        if self.enabled and share is not None:
            self._held.add(rid)

    def leave(self, rid) -> None:
        """``rid`` ended (idempotent; requests never counted are ignored)."""
        self._held.discard(rid)

    def _top_priority(self, qos_classes: dict) -> float:
        """Highest priority of the non-pinned classes (kept until tenants.yaml reloads)."""
        if self._classes is not qos_classes:
            unpinned = [q.priority for q in qos_classes.values() if not q.pinned]
            self._classes, self._top = qos_classes, max(max(unpinned, default=1), 1)
        return self._top

    # ---- control -------------------------------------------------------------------------
    def observe(self, lag_s: float) -> None:
        self._lags.append(max(0.0, lag_s))

    def adjust(self) -> None:
        """End of a window: move the limit by the window's median lag."""
        if not self._lags:
            return
        lag = statistics.median(self._lags)
        self._lags.clear()
        self.last_lag_s = lag
        binding = self.in_flight >= self.limit / 2
        self._quiet = 0 if lag > self.target_s or binding else self._quiet + 1
        if lag > self.target_s:
            self.limit = max(self.min_limit, math.floor(min(self.limit, self.in_flight) * BACKOFF))
        elif binding and self.limit != math.inf:
            self.limit += max(1.0, self.limit * GROWTH)
        elif self._quiet >= RELAX_WINDOWS:
            self.limit = math.inf            # demand fell well under the limit: forget it
        if self.metrics is not None:
            self.metrics.overload_guard(lag, self.limit, self.in_flight, self.where)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = start_background(self._run())

    async def _run(self) -> None:
        window_end = time.perf_counter() + WINDOW_S
        while True:
            before = time.perf_counter()
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            self.observe(now - before - TICK_S)
            if now >= window_end:
                self.adjust()
                window_end = now + WINDOW_S
                if (now - self._last_request > IDLE_STOP_S and self.in_flight == 0
                        and self.limit == math.inf):
                    return                     # idle: no wake-ups until the next request

    def state(self) -> dict:
        """For /admin/status."""
        return {"enabled": self.enabled, "lag_target_ms": None if not self.enabled else self.target_s * 1000,
                "loop_lag_ms": round(self.last_lag_s * 1000, 3),
                "limit": None if self.limit == math.inf else int(self.limit),
                "in_flight": self.in_flight, "shed_total": self.shed}


__all__ = ["OverloadGuard", "DEFAULT_LAG_TARGET_MS", "SHED_HEADER", "WINDOW_S"]
