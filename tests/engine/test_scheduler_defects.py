"""Scheduler defects under pressure, each reproduced: head-of-line stall, soft max_num_seqs,
idle credit, useless preemption, an inexact integrity check."""

from __future__ import annotations

import pytest

from kvharbor import LLM
from kvharbor.config import QoSSpec

from .conftest import greedy as _sp
from .conftest import random_prompt as _p

pytestmark = pytest.mark.timeout(300)       # a stalled scheduler fails, never hangs the suite


def _run(engine, max_steps: int = 400) -> dict[str, int]:
    """Step until idle (bounded); finished request id -> output tokens."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = len(out.token_ids)
        engine.check_integrity()
    return done


def test_request_that_only_fits_with_pinned_prefix_blocks_is_rejected_at_once():
    """Blocks a pinned prefix holds forever are not capacity: such a request is refused with
    a ValueError (it used to be accepted, then stalled every request behind it)."""
    llm = LLM(device="cpu", num_kv_blocks=32)
    assert llm.engine.pin_prefix(_p(320, 1), qos="standard") == 20        # 12 blocks left
    with pytest.raises(ValueError, match=r"needs 20 KV blocks but only 12 exist.*pinned prefixes"):
        llm.generate([_p(300, 2)], _sp(20))
    # A request that reuses the pinned prefix needs only its own blocks, so it is accepted.
    out = llm.generate([_p(320, 1) + _p(60, 3)], _sp(4))[0]
    assert out.num_cached_tokens == 320 and len(out.token_ids) == 4
    llm.check_integrity()


def test_a_pinned_prefix_in_the_pinned_region_makes_no_room_for_an_unpinned_class():
    """A premium prefix pinned in the pinned region is no hit for a standard request (it may
    not read region blocks), so it makes no room for one either: a standard request that
    would fit only by counting it is refused at once, not queued to stall."""
    llm = LLM(device="cpu", num_kv_blocks=64, pinned_kv_blocks=24)
    prefix = _p(320, 1)
    assert llm.engine.pin_prefix(prefix, qos="premium") == 20               # in the region
    capacity = llm.engine._capacity(llm.engine.add_request("probe", [1], _sp(1)))
    llm.engine.abort("probe")
    want = (capacity + 4) * 16 - 380                                        # 4 blocks too many
    with pytest.raises(ValueError, match=rf"needs {capacity + 4} KV blocks but only {capacity} exist"):
        llm.engine.add_request("big", prefix + _p(60, 2), _sp(want))
    out = llm.generate([prefix + _p(60, 2)], _sp(4), qos="premium")[0]     # premium reads it
    assert out.num_cached_tokens == 320
    llm.check_integrity()


def test_a_cached_prefix_that_may_be_evicted_does_not_make_a_request_fit():
    """Only hits on blocks pinned prefixes hold forever cost nothing: an ordinary cached
    prefix can be evicted before the request runs, so a request longer than the cache is
    refused even when its prefix is cached now."""
    llm = LLM(device="cpu", num_kv_blocks=32)
    prefix = _p(256, 1)                                              # 16 blocks, cached
    assert llm.generate([prefix], _sp(1))[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match=r"needs 40 KV blocks but only 32 exist"):
        llm.generate([prefix + _p(300, 2)], _sp(84))                 # 640 tokens: 40 blocks
    llm.check_integrity()


def test_request_that_stops_fitting_does_not_block_later_ones():
    """Capacity that shrinks after a request was queued (a prefix pinned meanwhile): the
    request is skipped, later requests run, and it is failed with a clear reason."""
    llm = LLM(device="cpu", num_kv_blocks=32)
    e = llm.engine
    e.add_request("big", _p(300, 2), _sp(20))                    # 20 blocks of 32: accepted
    e.add_request("small", _p(20, 3), _sp(3))
    e.pin_prefix(_p(320, 1), qos="standard")                      # now at most 12 are usable
    done = _run(e, max_steps=20)
    assert done.get("small") == 3, "a request that can never fit blocked the queue"
    failed = e.reject_unfittable()
    assert list(failed) == ["big"] and "needs 20 KV blocks but only 12" in failed["big"]
    assert not e.has_unfinished()
    e.check_integrity()


def test_a_request_waiting_for_blocks_is_not_overtaken_by_later_smaller_ones():
    """Head of line: ``big`` (12 blocks) waits while ``hog`` holds 14 of 24; the small
    requests queued after it would fit in the 10 free blocks, but they would take the blocks
    ``big`` waits for, again and again: none is admitted before ``big``."""
    llm = LLM(device="cpu", num_kv_blocks=24, max_num_seqs=16)
    e = llm.engine
    e.add_request("hog", _p(200, 0), _sp(24))                    # 14 blocks by its end
    e.step()
    e.add_request("big", _p(180, 1), _sp(8))                     # 12 blocks: only 10 free
    for i in range(4):
        e.add_request(f"small{i}", _p(20, 2 + i), _sp(4))        # 2 blocks each
    admitted: list[str] = []
    for _ in range(200):
        if not e.has_unfinished():
            break
        e.step()
        admitted += [r.request_id for r in e.scheduler.running if r.request_id not in admitted]
        e.check_integrity()
    assert admitted == ["hog", "big", "small0", "small1", "small2", "small3"], admitted


def test_generate_raises_instead_of_looping_forever():
    """A request of the call itself that stops fitting (a prefix pinned right after it was
    queued) ends ``generate`` with a ValueError, and the engine is left clean."""
    llm = LLM(device="cpu", num_kv_blocks=32)
    e = llm.engine
    add = e.add_request

    def add_then_pin(*args, **kwargs):
        req = add(*args, **kwargs)
        e.pin_prefix(_p(320, 1), qos="standard")
        return req

    e.add_request = add_then_pin
    with pytest.raises(ValueError, match="needs 20 KV blocks but only 12"):
        llm.generate([_p(300, 2)], _sp(20))
    assert not e.has_unfinished()
    llm.check_integrity()


def test_max_num_seqs_is_hard_and_premium_preempts_a_lower_class_for_a_seat():
    llm = LLM(device="cpu", num_kv_blocks=256, max_num_seqs=2)
    e = llm.engine
    e.add_request("batch-0", _p(30, 0), _sp(30), qos="batch")
    e.add_request("batch-1", _p(30, 1), _sp(30), qos="batch")
    e.step()
    assert len(e.scheduler.running) == 2
    e.add_request("premium", _p(30, 2), _sp(4), qos="premium")
    e.step()
    running = {r.request_id for r in e.scheduler.running}
    assert len(running) <= 2, f"max_num_seqs=2 but {sorted(running)} run"
    assert "premium" in running, "premium waited although a batch request could be preempted"
    assert e.scheduler.preemptions_by_qos == {"batch": 1}
    e.check_integrity()
    assert _run(e) == {"premium": 4, "batch-0": 30, "batch-1": 30}


def test_seat_is_not_taken_from_a_class_that_is_not_preemptible():
    llm = LLM(device="cpu", num_kv_blocks=256, max_num_seqs=1)
    e = llm.engine
    e.scheduler.preemptible["standard"] = False
    e.add_request("standard", _p(30, 0), _sp(6), qos="standard")
    e.step()
    e.add_request("premium", _p(30, 2), _sp(2), qos="premium")
    e.step()
    assert [r.request_id for r in e.scheduler.running] == ["standard"]
    assert e.scheduler.num_preemptions == 0
    assert _run(e) == {"standard": 6, "premium": 2}


def test_a_seat_is_never_taken_from_a_request_of_the_same_class():
    """Only a strictly lower class gives up its seat: two standard requests for one seat
    run one after the other, with no preemption (else they could take it in turns)."""
    llm = LLM(device="cpu", num_kv_blocks=256, max_num_seqs=1)
    e = llm.engine
    e.add_request("first", _p(30, 0), _sp(6), tenant="a", qos="standard")
    e.step()
    e.add_request("second", _p(30, 1), _sp(6), tenant="b", qos="standard")
    e.step()
    assert [r.request_id for r in e.scheduler.running] == ["first"]
    assert _run(e) == {"first": 6, "second": 6}
    assert e.scheduler.num_preemptions == 0


def test_a_tenant_that_went_quiet_earns_no_credit():
    llm = LLM(device="cpu", num_kv_blocks=256, max_num_seqs=1)
    e = llm.engine
    e.add_request("quiet-0", _p(40, 0), _sp(2), tenant="quiet")
    _run(e)
    for i in range(5):                                  # busy is served alone meanwhile
        e.add_request(f"busy-old-{i}", _p(40, 10 + i), _sp(2), tenant="busy")
    _run(e)
    for i in range(4):                                  # both come back at the same time
        e.add_request(f"quiet-{i + 1}", _p(40, 20 + i), _sp(2), tenant="quiet")
        e.add_request(f"busy-{i}", _p(40, 30 + i), _sp(2), tenant="busy")
    order = []
    while e.has_unfinished():
        for r in e.scheduler.running:
            if r.request_id not in order:
                order.append(r.request_id)
        e.step()
    # Credit from idling would run all four quiet requests first.
    assert order.index("busy-0") <= 2, order
    e.check_integrity()


def test_preemption_happens_only_when_it_lets_the_request_in():
    """Victims whose blocks are shared with a pinned prefix free almost nothing: preempting
    them must not happen when the freed blocks would still not be enough."""
    llm = LLM(device="cpu", num_kv_blocks=32, max_num_batched_tokens=1024)
    e = llm.engine
    prefix = _p(64, 1)
    e.pin_prefix(prefix, qos="standard")                         # 4 blocks held forever
    e.add_request("premium-a", _p(100, 2), _sp(20), qos="premium")
    for i in range(4):                                           # 4 shared + 1 own block each
        e.add_request(f"batch-{i}", prefix + _p(10, 10 + i), _sp(3), qos="batch")
    e.step()
    assert len(e.scheduler.running) == 5
    free = e.pool.num_free(True)
    needed = free + 4 + 2          # more than free + the 4 blocks the batch requests own
    e.add_request("premium-b", _p(needed * 16 - 8, 3), _sp(8), qos="premium")
    e.step()
    running = {r.request_id for r in e.scheduler.running}
    assert e.scheduler.num_preemptions == 0 or "premium-b" in running, \
        "batch requests were preempted for a request that still did not fit"
    e.check_integrity()
    assert set(_run(e)) == {"premium-a", "premium-b", "batch-0", "batch-1", "batch-2", "batch-3"}


def _gold_running_beside(rid: str, qos: str, blocks: int):
    """An engine whose classes are a pinned "gold" ranked lowest (priority 10), "batch" (20)
    and "standard" (50), running a gold request on 8 pinned-region blocks and ``rid`` of
    ``qos`` on ``blocks`` shared ones. Returns (engine, free shared blocks)."""
    classes = {"gold": QoSSpec(priority=10, pinned=True), "batch": QoSSpec(priority=20),
               "standard": QoSSpec(priority=50)}
    llm = LLM(device="cpu", num_kv_blocks=32, pinned_kv_blocks=16, qos_classes=classes,
              max_num_batched_tokens=1024)
    e = llm.engine
    e.add_request("gold", _p(8 * 16 - 8, 1), _sp(20), qos="gold")
    e.add_request(rid, _p(blocks * 16 - 8, 2), _sp(20), qos=qos)
    e.step()
    assert all(b.region == "pinned" for b in e.requests["gold"].blocks)
    return e, e.pool.num_free(False)


def test_preemption_does_not_count_pinned_blocks_for_a_class_that_cannot_use_them():
    """A pinned class ranked below a shared one (tenants.yaml allows it): its running request
    holds pinned-region blocks, which a waiting shared-class request can never take, so it is
    not preempted for one that still would not fit."""
    e, free = _gold_running_beside("std-a", "standard", 12)
    e.add_request("std-b", _p((free + 2) * 16 - 8, 3), _sp(4), qos="standard")
    e.step()
    assert e.scheduler.num_preemptions == 0, "gold was preempted although its blocks are of no use"
    assert "gold" in {r.request_id for r in e.scheduler.running}
    e.check_integrity()
    assert set(_run(e)) == {"gold", "std-a", "std-b"}


def test_a_victim_that_frees_nothing_usable_is_passed_over_for_one_that_does():
    """Two lower-class requests run: a pinned class ranked lowest (its blocks in the pinned
    region) and a batch class (shared blocks). A standard request that needs room takes it
    from the batch request only; the pinned-class one, first in victim order, would free
    nothing the standard request may use."""
    e, free = _gold_running_beside("batch", "batch", 6)
    e.add_request("standard", _p((free + 4) * 16 - 8, 3), _sp(4), qos="standard")
    e.step()
    assert e.scheduler.preemptions_by_qos == {"batch": 1}
    assert {r.request_id for r in e.scheduler.running} == {"gold", "standard"}
    e.check_integrity()
    assert _run(e) == {"gold": 20, "batch": 20, "standard": 4}


def test_a_victims_blocks_that_are_the_requests_own_prefix_hit_make_no_room():
    """A premium request whose prompt starts with a batch request's whole prompt would hit
    that request's 4 blocks: preempting it gives those back only as the premium request's own
    hits, so they make no room for the rest. With 2 free blocks, 1 more the batch request
    owns and 7 needed, it is not preempted (the standard request beside it is not
    preemptible); counting its hit blocks as room preempted it for nothing."""
    llm = LLM(device="cpu", num_kv_blocks=13)
    e = llm.engine
    e.scheduler.preemptible["standard"] = False
    prompt = _p(64, 1)
    e.add_request("batch", prompt, _sp(20), qos="batch")           # 4 prompt blocks + 1
    e.add_request("standard", _p(90, 2), _sp(30), qos="standard")  # 6 blocks
    e.step()
    e.step()
    assert e.pool.num_free(False) == 2
    e.add_request("premium", prompt + _p(100, 3), _sp(2), qos="premium")   # 11 blocks, 4 hit
    e.step()
    assert e.scheduler.num_preemptions == 0, "the batch request was preempted for nothing"
    assert {r.request_id for r in e.scheduler.running} == {"batch", "standard"}
    e.check_integrity()
    assert _run(e) == {"batch": 20, "standard": 30, "premium": 2}


def test_check_integrity_catches_a_leaked_reference_and_too_many_running():
    llm = LLM(device="cpu", num_kv_blocks=64, max_num_seqs=2)
    e = llm.engine
    e.add_request("a", _p(40, 0), _sp(8))
    e.step()
    e.check_integrity()
    leaked = e.scheduler.running[0].blocks[0]
    e.pool.touch([leaked])                                       # a reference nobody holds
    with pytest.raises(AssertionError, match="ref_cnt 2 != 1 holders"):
        e.check_integrity()
    e.pool.release([leaked])
    e.check_integrity()
    e.scheduler.max_num_seqs = 0
    with pytest.raises(AssertionError, match="max_num_seqs"):
        e.check_integrity()


def test_check_integrity_catches_a_wrong_pin_count_a_waiting_holder_and_a_double_queue():
    llm = LLM(device="cpu", num_kv_blocks=64, max_num_seqs=1)
    e, sched = llm.engine, llm.engine.scheduler
    e.add_request("a", _p(40, 0), _sp(8))
    e.step()
    e.add_request("w", _p(40, 1), _sp(8))                       # waits: one seat
    e.check_integrity()
    block = sched.running[0].blocks[0]
    block.pin_cnt += 1                # no pinned prefix holds it (the pool's own count agrees)
    e.pool.permanent[block.region] += 1
    with pytest.raises(AssertionError, match="pin count"):
        e.check_integrity()
    block.pin_cnt -= 1
    e.pool.permanent[block.region] -= 1
    (waiting,) = sched.waiting
    waiting.blocks.append(block)
    with pytest.raises(AssertionError, match="waiting request holds blocks"):
        e.check_integrity()
    waiting.blocks.clear()
    e.check_integrity()
    sched.waiting.append(waiting)                                # and in its class queue twice
    next(q for q in sched.queues.values() if waiting in q).append(waiting)
    with pytest.raises(AssertionError, match="queued twice"):
        e.check_integrity()


def test_the_engines_check_includes_the_pools_the_host_tiers_and_the_sessions_own():
    """``Engine.check_integrity`` runs the block pool's, the host tier's and the session
    manager's own checks: a null block in use, a host slot lost or a broken session fails the
    engine's check, not only theirs."""
    llm = LLM(device="cpu", num_kv_blocks=32, host_kv_blocks=8)
    e = llm.engine
    e.add_request("a", _p(40, 0), _sp(4), tenant="acme", session_id="s")
    assert _run(e) == {"a": 4}
    e.check_integrity()
    session = e.sessions.sessions[("acme", "s")]
    session.active = -1
    with pytest.raises(AssertionError, match="broken"):
        e.check_integrity()
    session.active = 0
    e.check_integrity()
    e.pool.null_block.block_hash = b"h"
    with pytest.raises(AssertionError, match="null block used"):
        e.check_integrity()
    e.pool.null_block.block_hash = None
    e.check_integrity()
    e.host.free.pop()
    with pytest.raises(AssertionError, match="host slot lost"):
        e.check_integrity()
