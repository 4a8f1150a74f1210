"""The session manager's release rules alone (no model): the ttl at its edge, how often expiry
looks, a manager without a cap, and its integrity check. With a model: ``test_sessions.py``."""

from __future__ import annotations

import pytest

from kvharbor.engine.block_pool import BlockPool
from kvharbor.engine.request import Request, SamplingParams
from kvharbor.engine.sessions import SessionLimits, SessionManager
from tests.engine.test_sessions import FakeClock


def _manager(limits: SessionLimits | None = None) -> tuple[SessionManager, FakeClock]:
    clock = FakeClock()
    return SessionManager(BlockPool(8), 16, limits, clock=clock), clock


def _turn(sessions: SessionManager, session_id: str, tenant: str = "acme") -> None:
    """One turn of ``session_id`` that computed nothing (the session holds no block)."""
    req = Request(f"{session_id}-turn", [1, 2, 3], SamplingParams(), tenant=tenant, session_id=session_id)
    sessions.begin(req)
    sessions.end_turn(req)


def test_a_session_expires_when_its_ttl_has_passed_not_before():
    sessions, clock = _manager(SessionLimits(ttl_s=10.0))
    t0 = clock.now
    _turn(sessions, "s")
    clock.now = t0 + 9.99
    assert sessions.expire(force=True) == 0
    clock.now = t0 + 10.0
    assert sessions.expire(force=True) == 1 and sessions.describe("acme", "s") is None
    sessions.check_integrity()


def test_expiry_looks_at_most_every_quarter_second():
    """``expire`` runs at every engine step: it scans the idle sessions only when 0.25 s have
    passed since its last scan (``force`` scans now)."""
    sessions, clock = _manager(SessionLimits(ttl_s=0.1))
    t0 = clock.now
    assert sessions.expire() == 0                 # scans at t0: nothing to expire; next at t0 + 0.25
    _turn(sessions, "s")
    clock.now = t0 + 0.2                          # past the ttl, but within the quarter second
    assert sessions.expire() == 0 and sessions.describe("acme", "s") is not None
    clock.now = t0 + 0.25
    assert sessions.expire() == 1
    _turn(sessions, "t")
    clock.now = t0 + 0.4
    assert sessions.expire() == 0 and sessions.expire(force=True) == 1


def test_without_a_cap_a_tenants_idle_sessions_are_all_kept():
    sessions, _ = _manager()
    for i in range(5):
        _turn(sessions, f"s{i}")
    assert len(sessions.idle) == 5 and sessions.evicted == 0
    sessions.check_integrity()


@pytest.mark.parametrize("how", ["negative active", "wrong key"])
def test_check_integrity_catches_a_broken_session(how):
    sessions, _ = _manager()
    _turn(sessions, "s")
    session = sessions.sessions[("acme", "s")]
    if how == "negative active":
        session.active = -1
    else:
        session.key = ("acme", "other")
    with pytest.raises(AssertionError, match="broken"):
        sessions.check_integrity()
