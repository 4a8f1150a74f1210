"""Sessions: a conversation's KV blocks kept referenced between its turns.

A session is keyed by ``(tenant, session id)``: the same id sent by another tenant is another
session. While a turn runs, its request holds its blocks like any other request. When the
turn ends (finished or aborted), the session takes one reference on every full, cached block
of the turn's prompt + output (the longest chain of block hashes the pool holds), then drops
its references to the previous turn's blocks (new first, so shared history never reaches
ref count 0). Referenced blocks are *used*, never in a free queue, so no other tenant's
pressure can evict them::

    turn 1 ends:   session holds [h0][h1][h2]            (prompt + output, full blocks)
    turn 2 runs:   prefix hit on  [h0][h1][h2], computes [h3][h4] ...
    turn 2 ends:   session holds [h0][h1][h2][h3][h4]    (then releases its old refs)

A session is *idle* between turns. Idle sessions are released (their blocks return to the
LRU free queue, tail first) when:

* their ``ttl_s`` passes without a new turn (``expire``), or
* the tenant's idle sessions hold more than ``max_blocks`` block references (oldest idle
  session released first, ``_enforce_cap``), or
* the engine made no progress because every free block is held (``release_oldest_idle``:
  retention never starves the engine), or
* ``end`` is called (``DELETE /v1/sessions/{id}``).

``fork`` starts a new session holding the same blocks as an existing one (one more reference
each, no copy and no recompute, like llama.cpp's ``seq_cp``); the two then diverge, each
keeping only its own turns' blocks.

Invariants: every reference the manager holds is listed in exactly one ``Session.blocks``;
``num_idle_blocks[tenant]`` equals the sum of ``len(s.blocks)`` over the tenant's idle
sessions. Units: seconds (``clock``, default ``time.monotonic``), blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_pool import BlockPool, KVCacheBlock
from .request import Request

SessionKey = tuple[str, str]          # (tenant, session id)


@dataclass(slots=True)
class SessionLimits:
    """Retention rules of one tenant: idle lifetime (s) and the cap on idle-held blocks."""

    ttl_s: float = 300.0
    max_blocks: int | None = None      # None: no cap (the no-progress release still applies)


@dataclass(slots=True, eq=False)
class Session:
    """One conversation's retained state."""

    key: SessionKey
    blocks: list[KVCacheBlock] = field(default_factory=list)
    active: int = 0                    # turns running now
    last_used: float = 0.0             # clock time the last turn ended (or started)
    turns: int = 0
    hit_tokens: int = 0                # prefix-hit tokens of its turns after the first

    @property
    def num_tokens_held(self) -> int:
        return len(self.blocks)


class SessionManager:
    """Owns every session of one engine (see module doc). Not thread-safe, no Ray."""

    def __init__(self, pool: BlockPool, block_size: int, default: SessionLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.block_size = pool, block_size
        self.default = default or SessionLimits()
        self.limits: dict[str, SessionLimits] = {}      # per tenant overrides
        self.clock = clock
        self.sessions: dict[SessionKey, Session] = {}
        self.idle: OrderedDict[SessionKey, Session] = OrderedDict()   # least recently used first
        self.num_idle_blocks: dict[str, int] = {}
        self.expirations = 0           # released by ttl
        self.evicted = 0               # released by the cap or the no-progress rule
        self.hit_tokens = 0            # prefix-hit tokens of session turns after the first
        self._next_check = 0.0

    def limits_for(self, tenant: str) -> SessionLimits:
        return self.limits.get(tenant, self.default)

    # ---- turns ------------------------------------------------------------------------
    def begin(self, req: Request) -> None:
        """A turn of ``req.session_id`` was queued: the session is active (created if new)."""
        key = (req.tenant, req.session_id)
        session = self.sessions.get(key)
        if session is None:
            session = self.sessions[key] = Session(key)
        elif session.active == 0:
            self._leave_idle(session)
        session.active += 1
        session.last_used = self.clock()

    def end_turn(self, req: Request) -> None:
        """``req`` finished or was aborted: retain its full cached blocks (module doc).

        Call before the request's own blocks are freed.
        """
        session = self.sessions.get((req.tenant, req.session_id))
        if session is None:                      # ended (DELETE) while the turn ran
            return
        session.active -= 1
        session.turns += 1
        if session.turns > 1 and req.num_cached_tokens > 0:
            session.hit_tokens += req.num_cached_tokens
            self.hit_tokens += req.num_cached_tokens
        held = self._chain(req)
        if held:
            self.pool.touch(held)
            self.pool.release(reversed(session.blocks))
            session.blocks = held
        session.last_used = self.clock()
        if session.active == 0:
            self._enter_idle(session)

    def _chain(self, req: Request) -> list[KVCacheBlock]:
        """Blocks the pool holds for ``req``'s full computed blocks, from the first on."""
        req.update_block_hashes(self.block_size)
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        chain = []
        for block_hash in req.block_hashes[:num_full]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            chain.append(block)
        return chain

    # ---- idle bookkeeping ---------------------------------------------------------------
    def _enter_idle(self, session: Session) -> None:
        tenant = session.key[0]
        self.idle[session.key] = session
        self.num_idle_blocks[tenant] = self.num_idle_blocks.get(tenant, 0) + len(session.blocks)
        self._enforce_cap(tenant)

    def _leave_idle(self, session: Session) -> None:
        tenant = session.key[0]
        del self.idle[session.key]
        self.num_idle_blocks[tenant] -= len(session.blocks)

    def _enforce_cap(self, tenant: str) -> None:
        """Release the tenant's oldest idle sessions while they hold more than the cap."""
        cap = self.limits_for(tenant).max_blocks
        if cap is None:
            return
        for key in [k for k in self.idle if k[0] == tenant]:
            if self.num_idle_blocks.get(tenant, 0) <= cap:
                return
            self._release(self.idle[key])
            self.evicted += 1

    def _release(self, session: Session) -> int:
        """Forget ``session`` and drop its references (blocks go to the free queue's tail)."""
        if session.active == 0 and session.key in self.idle:
            self._leave_idle(session)
        self.sessions.pop(session.key, None)
        n = len(session.blocks)
        self.pool.release(reversed(session.blocks))
        session.blocks = []
        return n

    # ---- release rules ------------------------------------------------------------------
    def expire(self, force: bool = False) -> int:
        """Release idle sessions past their ttl (at most every 0.25 s unless ``force``).
        Returns how many expired."""
        now = self.clock()
        if not force and now < self._next_check:
            return 0
        self._next_check = now + 0.25
        expired = [s for s in self.idle.values() if now - s.last_used >= self.limits_for(s.key[0]).ttl_s]
        for session in expired:
            self._release(session)
        self.expirations += len(expired)
        return len(expired)

    def release_oldest_idle(self) -> bool:
        """Release the least recently used idle session holding blocks (the engine is stuck)."""
        for session in self.idle.values():
            if session.blocks:
                self._release(session)
                self.evicted += 1
                return True
        return False

    def fork(self, tenant: str, source: str, target: str) -> int | None:
        """Start session ``target`` from ``source``'s retained blocks. Returns the blocks it
        holds, or None when ``source`` is unknown. Raises ValueError if ``target`` exists."""
        src = self.sessions.get((tenant, source))
        if src is None:
            return None
        if (tenant, target) in self.sessions:
            raise ValueError(f"session {target!r} already exists; end it first or pick another id")
        dst = self.sessions[(tenant, target)] = Session((tenant, target), list(src.blocks),
                                                        last_used=self.clock(), turns=src.turns)
        self.pool.touch(dst.blocks)
        self._enter_idle(dst)
        return len(dst.blocks) if (tenant, target) in self.sessions else 0

    def end_all(self, tenants=None) -> int:
        """End every session (a cache flush), or every session of ``tenants``. Returns how many."""
        sessions = [s for key, s in self.sessions.items() if tenants is None or key[0] in tenants]
        for session in sessions:
            self._release(session)
        return len(sessions)

    def end(self, tenant: str, session_id: str) -> int | None:
        """End a session now. Returns the block references released, or None if unknown."""
        session = self.sessions.get((tenant, session_id))
        if session is None:
            return None
        return self._release(session)

    # ---- accounting ---------------------------------------------------------------------
    def held_blocks(self) -> list[KVCacheBlock]:
        """Every block reference the sessions hold (a block once per holding session)."""
        return [b for s in self.sessions.values() for b in s.blocks]

    def blocks_by_tenant(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (tenant, _), s in self.sessions.items():
            out[tenant] = out.get(tenant, 0) + len(s.blocks)
        return out

    def describe(self, tenant: str, session_id: str) -> dict | None:
        s = self.sessions.get((tenant, session_id))
        if s is None:
            return None
        return {"blocks": len(s.blocks), "tokens": len(s.blocks) * self.block_size,
                "active": s.active, "turns": s.turns, "hit_tokens": s.hit_tokens}

    def stats(self) -> dict:
        return {"sessions_active": len(self.sessions), "sessions_idle": len(self.idle),
                "session_blocks_held": sum(len(s.blocks) for s in self.sessions.values()),
                "session_expirations": self.expirations, "session_evictions": self.evicted,
                "session_hit_tokens": self.hit_tokens}

    def check_integrity(self) -> None:
        """Assert the idle map and per-tenant idle counts agree with the sessions."""
        counts: dict[str, int] = {}
        for key, s in self.sessions.items():
            assert s.key == key and s.active >= 0, f"session {key} broken"
            assert (s.active == 0) == (key in self.idle), f"session {key} idle state"
            if s.active == 0:
                counts[key[0]] = counts.get(key[0], 0) + len(s.blocks)
        assert set(self.idle) <= set(self.sessions), "idle session not in the session map"
        for tenant, n in self.num_idle_blocks.items():
            assert counts.get(tenant, 0) == n, f"tenant {tenant}: idle blocks {n} != {counts.get(tenant, 0)}"
