"""``Engine.check_integrity()``: the engine's invariants, asserted (tests and debugging; never
on the hot path).

- the block pool's and the host tier's own invariants;
- each device block's ref count equals its holders (running requests' block tables,
  sessions, pinned prefixes) and its pin count the pinned prefixes holding it;
- waiting requests hold no blocks; running requests are at most ``max_num_seqs``;
- every unfinished request is queued exactly once (running or waiting).
"""

from __future__ import annotations


def check_engine(engine) -> None:
    """Raise AssertionError naming the first broken invariant of ``engine`` (module doc)."""
    engine.pool.check_integrity()
    if engine.host is not None:
        engine.host.check_integrity()
    sched, null = engine.scheduler, engine.pool.null_block
    holders: dict[int, int] = {}
    for req in sched.running:
        for b in req.blocks:
            if b is not null:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for b in engine.sessions.held_blocks():
        holders[b.block_id] = holders.get(b.block_id, 0) + 1
    engine.sessions.check_integrity()
    pins: dict[int, int] = {}
    for prefix in engine.pinned_prefixes:
        for b in prefix:
            pins[b.block_id] = pins.get(b.block_id, 0) + 1
    for b in engine.pool.blocks:
        want = holders.get(b.block_id, 0) + pins.get(b.block_id, 0)
        assert b.ref_cnt == want, f"block {b.block_id}: ref_cnt {b.ref_cnt} != {want} holders"
        assert b.pin_cnt == pins.get(b.block_id, 0), f"block {b.block_id}: pin count"
    assert all(not r.blocks for r in sched.waiting), "waiting request holds blocks"
    assert len(sched.running) <= sched.max_num_seqs, \
        f"{len(sched.running)} running > max_num_seqs {sched.max_num_seqs}"
    queues: dict = {}
    for r in sorted(sched.waiting, key=lambda r: r.arrival_seq):
        queues.setdefault((r.priority, r.qos, r.tenant), []).append(r)
    assert {k: [id(r) for r in q] for k, q in sched.queues.items()} == \
        {k: [id(r) for r in q] for k, q in queues.items()}, "class queues != waiting requests"
    queued = [r.request_id for r in sched.running + sched.waiting]
    assert len(queued) == len(set(queued)), "a request is queued twice"
    assert set(queued) == set(engine.requests), "queued requests != unfinished requests"
