"""The gateway's overload guard: lower classes shed first when the gateway's loop lags, premium
never; a shed request costs no control-plane call; the limit recovers when the lag goes."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from kvharbor.platform.error_body import APIError
from kvharbor.platform.overload_guard import MIN_LIMIT, RELAX_WINDOWS, OverloadGuard
from tests.tenants.fast_lane_harness import Cluster, request, run

CLASSES = {"premium": SimpleNamespace(priority=100, pinned=True, max_queue=10_000),
           "standard": SimpleNamespace(priority=50, pinned=False, max_queue=10_000),
           "batch": SimpleNamespace(priority=10, pinned=False, max_queue=10_000)}
LAGGING, ON_TIME = 0.05, 0.001      # window medians against the 10 ms target


def fill(guard: OverloadGuard, qos: str, n: int, prefix: str) -> list[str]:
    """Enter ``n`` requests of ``qos``; the ids that got in."""
    ids = []
    for i in range(n):
        try:
            guard.enter(f"{prefix}{i}", CLASSES[qos], CLASSES)
            ids.append(f"{prefix}{i}")
        except APIError:
            pass
    return ids


def window(guard: OverloadGuard, lag_s: float) -> None:
    guard.observe(lag_s)
    guard.adjust()


@pytest.fixture
def guard(monkeypatch):
    g = OverloadGuard(10.0)
    monkeypatch.setattr(g, "_ensure_running", lambda: None)   # windows are driven by the test
    return g


def test_nothing_is_shed_before_the_loop_lags(guard):
    assert len(fill(guard, "batch", 1000, "b")) == 1000
    window(guard, ON_TIME)
    assert guard.limit == math.inf and len(fill(guard, "batch", 10, "c")) == 10


def test_a_lagging_loop_sheds_the_lowest_class_first_and_never_premium(guard):
    standard = fill(guard, "standard", 40, "s")
    window(guard, LAGGING)
    assert guard.limit == 32                          # 40 in flight x 0.8
    with pytest.raises(APIError) as refused:
        guard.enter("s-more", CLASSES["standard"], CLASSES)
    assert refused.value.status == 429 and refused.value.code == "overloaded"
    assert refused.value.headers["Retry-After"] == "1"
    assert len(fill(guard, "premium", 50, "p")) == 50 and guard.in_flight == 40
    for rid in standard[:15]:                         # 25 in flight: standard fits, batch not
        guard.leave(rid)
    assert fill(guard, "standard", 1, "x") == ["x0"]
    assert fill(guard, "batch", 1, "b") == []         # batch sheds at 32 x 10/50 -> MIN_LIMIT
    for rid in standard[15:]:
        guard.leave(rid)
    guard.leave("x0")
    assert guard.in_flight == 0
    assert len(fill(guard, "batch", 10, "b2")) == MIN_LIMIT
    assert guard.shed == 1 + 1 + (10 - MIN_LIMIT)


def test_each_window_reaches_the_dashboard_and_the_status_page(guard):
    """Every window's lag, limit and in-flight count go to the metrics (the overload panel), and
    /admin/status shows the limit: null while there is none."""
    seen = []
    guard.metrics = SimpleNamespace(overload_guard=lambda *args: seen.append(args))
    assert guard.state()["limit"] is None
    fill(guard, "standard", 40, "s")
    window(guard, LAGGING)
    assert seen == [(LAGGING, 32, 40, "gateway")]
    assert guard.state() == {"enabled": True, "lag_target_ms": 10.0, "loop_lag_ms": 50.0, "limit": 32,
                             "in_flight": 40, "shed_total": 0}


def test_classes_of_priority_zero_share_the_floor(guard):
    """tenants.yaml allows priority 0: before the loop has lagged none of it is shed (the
    unbounded limit times a share of 0 is NaN, which once made the threshold MIN_LIMIT on an
    idle gateway), and under a lagging loop, with no unpinned class above it, each class still
    gets MIN_LIMIT requests (no division by a top priority of 0)."""
    flat = {name: SimpleNamespace(priority=0, pinned=False, max_queue=10) for name in ("a", "b")}
    for i in range(20):
        guard.enter(f"r{i}", flat["a"], flat)          # no limit yet: all counted
    window(guard, LAGGING)
    assert guard.limit == 16
    for i in range(20 - MIN_LIMIT + 1):
        guard.leave(f"r{i}")                           # MIN_LIMIT - 1 left in flight
    guard.enter("last", flat["b"], flat)               # a share of 0: the floor, one more fits
    with pytest.raises(APIError):
        guard.enter("over", flat["b"], flat)


def test_the_limit_has_a_floor_grows_while_binding_and_lifts_when_demand_falls(guard):
    held = fill(guard, "standard", 100, "s")
    for _ in range(20):
        window(guard, LAGGING)
    assert guard.limit == MIN_LIMIT
    for rid in held[5:]:
        guard.leave(rid)
    window(guard, ON_TIME)                            # 5 in flight >= 8/2: binding, so it grows
    assert guard.limit == MIN_LIMIT + 1
    for rid in held[:MIN_LIMIT]:
        guard.leave(rid)
    for _ in range(RELAX_WINDOWS - 1):
        window(guard, ON_TIME)
    assert guard.limit == MIN_LIMIT + 1               # not yet
    window(guard, ON_TIME)
    assert guard.limit == math.inf


def test_the_limit_grows_by_an_eighth_and_one_slow_tick_does_not_cut_it(guard):
    fill(guard, "standard", 40, "s")
    window(guard, LAGGING)
    assert guard.limit == 32
    window(guard, ON_TIME)                            # 40 in flight: binding
    assert guard.limit == 36                          # + 32 / 8
    for _ in range(9):                                # one 200 ms pause among ten ticks
        guard.observe(ON_TIME)
    window(guard, 0.2)
    assert guard.limit > 36                           # the median tick was on time


def test_a_window_exactly_at_the_target_is_on_time_and_half_the_limit_binds(guard):
    """The guard cuts only on a lag *above* its target: a window whose median equals the target
    neither cuts the limit nor stops the count toward lifting it. And in flight at exactly half
    the limit counts as binding: the limit grows."""
    held = fill(guard, "standard", 40, "s")
    window(guard, LAGGING)
    assert guard.limit == 32
    for rid in held[16:]:                             # 16 in flight: exactly half of 32
        guard.leave(rid)
    window(guard, guard.target_s)
    assert guard.limit == 36                          # not cut: grown by an eighth
    for rid in held[:16]:
        guard.leave(rid)
    for _ in range(RELAX_WINDOWS):                    # nothing in flight, lag at the target
        window(guard, guard.target_s)
    assert guard.limit == math.inf


def test_shares_follow_the_classes_of_a_reloaded_tenants_file(guard):
    """The top non-pinned priority is recomputed when tenants.yaml's classes change: a new
    higher class halves standard's share of the limit."""
    fill(guard, "standard", 40, "s")
    window(guard, LAGGING)                            # limit 32; standard alone: share 1
    assert guard.share(CLASSES["standard"], CLASSES) == 1.0
    reloaded = {**CLASSES, "gold": SimpleNamespace(priority=100, pinned=False, max_queue=10_000)}
    assert guard.share(CLASSES["standard"], reloaded) == 0.5
    with pytest.raises(APIError):                     # 40 in flight >= 32 x 0.5
        guard.enter("s-more", CLASSES["standard"], reloaded)


def test_leave_is_idempotent_and_ignores_requests_it_never_counted(guard):
    [rid] = fill(guard, "standard", 1, "s")
    fill(guard, "premium", 1, "p")
    guard.leave(rid)
    guard.leave(rid)
    guard.leave("p0")
    guard.leave("never")
    assert guard.in_flight == 0


def test_off_means_off():
    guard = OverloadGuard(None)
    assert not guard.enabled
    assert len(fill(guard, "batch", 500, "b")) == 500 and guard.in_flight == 0


def test_the_monitor_measures_a_blocked_loop_and_sets_the_limit():
    guard = OverloadGuard(10.0)

    async def scenario():
        held = fill(guard, "standard", 20, "s")       # starts the monitor on this loop
        assert held and guard._task is not None
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            time.sleep(0.03)                          # handlers that hog the loop
            await asyncio.sleep(0)
        guard._task.cancel()

    run(scenario())
    assert guard.last_lag_s > 0.01 and MIN_LIMIT <= guard.limit <= 16   # 20 in flight x 0.8


def test_a_pause_as_the_monitor_starts_does_not_cut_the_limit():
    """The first window is as long as every other: a gateway that stalls once just after its
    first request (a cold import, a first connection) keeps serving all classes, since the
    median of that window's ticks is on time."""
    guard = OverloadGuard(10.0)

    async def scenario():
        fill(guard, "standard", 40, "s")              # starts the monitor on this loop
        await asyncio.sleep(0)                        # its first tick is armed
        time.sleep(0.06)                              # one stall, then an idle loop
        await asyncio.sleep(0.4)                      # more than one window
        assert guard.limit == math.inf and len(fill(guard, "batch", 10, "b")) == 10
        guard._task.cancel()

    run(scenario())


def test_the_tick_stops_when_the_gateway_is_idle_and_the_next_request_restarts_it(monkeypatch):
    import kvharbor.platform.overload_guard as og

    monkeypatch.setattr(og, "IDLE_STOP_S", 0.3)
    guard = OverloadGuard(10.0)

    async def scenario():
        [rid] = fill(guard, "standard", 1, "s")
        first = guard._task
        await asyncio.sleep(0.8)
        assert not first.done()                       # a request is in flight
        guard.leave(rid)
        await asyncio.sleep(0.9)
        assert first.done()                           # idle: stopped by itself
        fill(guard, "premium", 1, "p")                # pinned requests do not start it
        assert guard._task is first
        fill(guard, "batch", 1, "b")
        assert guard._task is not first and not guard._task.done()
        guard._task.cancel()

    run(scenario())


def test_a_shed_request_makes_no_actor_call_and_its_slot_is_never_held():
    cluster = Cluster()
    cluster.registry.config.qos_classes = CLASSES
    gw = cluster.gateway()
    gw.guard = guard = OverloadGuard(10.0)
    guard._ensure_running = lambda: None
    standard = cluster.principal("globex", "standard")

    async def scenario():
        tickets = [await request(gw, standard, f"s{i}") for i in range(10)]
        assert not any(isinstance(t, APIError) for t in tickets)
        window(guard, LAGGING)                        # limit 8
        calls = dict(cluster.calls)
        refused = await request(gw, standard, "s-shed")
        assert isinstance(refused, APIError) and refused.code == "overloaded"
        assert cluster.calls == calls                 # no class-queue or admission call
        for i in range(10):
            gw.leave("standard", f"s{i}")
        assert guard.in_flight == 0
        cluster.registry.config.qos_classes = {**CLASSES, "standard": SimpleNamespace(
            priority=50, pinned=False, max_queue=0)}     # the class queue refuses everything
        refused = await request(gw, cluster.principal("globex", "standard"), "s-q")
        assert isinstance(refused, APIError) and refused.code == "queue_full"
        assert guard.in_flight == 0                   # the guard's count was given back

    run(scenario())


# ---- over HTTP: the key check refuses before the body is read ------------------------------
def _gated_app(guard: OverloadGuard, qos: str, reached: list):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from kvharbor.platform.auth_gate import AuthGateMiddleware

    async def completions(request):
        reached.append(await request.body())
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.state.max_body_bytes = 1 << 20

    def authenticate(key, path):                    # what Gateway._gate does for generation paths
        guard.check(CLASSES[qos], CLASSES)
        return SimpleNamespace(qos=CLASSES[qos])

    app.state.authenticate = authenticate
    app.add_middleware(AuthGateMiddleware)            # as the gateway's FastAPI app does
    return app


@pytest.mark.parametrize("qos", ["batch", "premium"])
def test_an_overloaded_gateway_answers_429_with_retry_after_and_keeps_the_connection(guard, qos):
    import httpx

    fill(guard, "standard", 40, "s")
    window(guard, LAGGING)                            # limit 32: batch sheds, premium never
    reached: list = []

    async def scenario():
        transport = httpx.ASGITransport(app=_gated_app(guard, qos, reached))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", json={"prompt": "x" * 5000},
                                     headers={"Authorization": "Bearer k"})

    resp = run(scenario())
    if qos == "premium":
        assert resp.status_code == 200 and len(reached) == 1
        return
    assert resp.status_code == 429 and reached == []
    assert resp.json()["error"]["code"] == "overloaded" and "retry later" in resp.json()["error"]["message"]
    assert resp.headers["retry-after"] == "1" and resp.headers.get("connection") != "close"


def test_the_gateway_checks_the_guard_only_on_paths_that_tokenize():
    from kvharbor.platform.gateway import GENERATION_PATHS, Gateway

    checked, limited = [], []
    principal = SimpleNamespace(qos=CLASSES["batch"], tenant="initech")
    gw = SimpleNamespace(_start_watcher=lambda: None, _check_lane=lambda principal: None,
                         registry=SimpleNamespace(is_admin=lambda key: False,
                                                  authenticate=lambda key: principal,
                                                  config=SimpleNamespace(qos_classes=CLASSES)),
                         guard=SimpleNamespace(check=lambda qos, classes, tenant: checked.append(qos)),
                         metrics=SimpleNamespace(rate_limited=lambda *a: limited.append(a),
                                                 overload_guard=lambda *a: None))
    for path in (*GENERATION_PATHS, "/tokenize", "/detokenize", "/v1/models", "/v1/sessions/abc"):
        assert Gateway._gate(gw, "k", path) is principal
    assert checked == [CLASSES["batch"]] * (len(GENERATION_PATHS) + 2) and limited == []
    gw.guard = OverloadGuard(10.0, metrics=gw.metrics)   # one that sheds batch now
    gw.guard._ensure_running = lambda: None
    fill(gw.guard, "standard", 40, "s")
    window(gw.guard, LAGGING)
    with pytest.raises(APIError):
        Gateway._gate(gw, "k", "/v1/completions")
    assert limited == [("initech", "overloaded")]    # counted on the dashboard's panel


def test_the_tick_runs_on_while_short_requests_keep_coming_or_a_limit_is_set(monkeypatch):
    """Requests that each end within a tick still count as traffic: the tick stops only
    ``IDLE_STOP_S`` after the last one. And while a limit is set the tick goes on with nothing
    in flight, so the limit can be lifted (with the tick stopped it would shed forever)."""
    import kvharbor.platform.overload_guard as og

    monkeypatch.setattr(og, "IDLE_STOP_S", 0.5)
    guard = OverloadGuard(10.0)

    async def scenario():
        for i in range(12):                           # 1.2 s of short requests
            [rid] = fill(guard, "standard", 1, f"s{i}-")
            guard.leave(rid)
            await asyncio.sleep(0.1)
        assert not guard._task.done()
        for _ in range(50):                           # a lagging window (outvotes the real
            guard.observe(LAGGING)                    # ticks observed so far): a limit is set
        guard.adjust()
        assert guard.limit == MIN_LIMIT
        await asyncio.sleep(1.0)                      # idle for 2 x IDLE_STOP_S, 4 windows
        assert not guard._task.done() and guard.limit == MIN_LIMIT
        await asyncio.sleep((RELAX_WINDOWS + 2) * og.WINDOW_S)
        assert guard.limit == math.inf                # lifted; then it stops by itself
        await asyncio.sleep(og.WINDOW_S * 2)
        assert guard._task.done()

    run(scenario())
