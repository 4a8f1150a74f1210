"""The scheduler's two small policies, alone: per-tenant fairness inside a QoS class
(``fairness.FairShare``) and the choice of preemption victim and swap (``preemption``)."""

from __future__ import annotations

from types import SimpleNamespace

from kvharbor.engine.fairness import FairShare
from kvharbor.engine.preemption import PreemptionPolicy


def _req(tenant: str, qos: str = "standard") -> SimpleNamespace:
    return SimpleNamespace(tenant=tenant, qos=qos)


def _two_active(served_a: int, served_b: int) -> tuple[FairShare, SimpleNamespace, SimpleNamespace]:
    """Standard tenants ``a`` and ``b``, both active, served these many tokens."""
    fair = FairShare()
    a, b = _req("a"), _req("b")
    fair.arrive(a)
    fair.arrive(b)
    fair.charge(a, served_a)
    fair.charge(b, served_b)
    return fair, a, b


def test_tenants_are_ordered_by_tokens_served_not_by_requests():
    fair, a, b = _two_active(500, 10)                 # one long request against a short one
    for _ in range(2):                                # and two more short ones
        fair.charge(b, 10)
    assert fair.key(b) < fair.key(a)


def test_a_tenant_already_active_keeps_its_place_when_it_sends_more():
    """``a`` is behind ``b`` (served less) and sends another request while its first is still
    queued: it stays behind, so it still goes first."""
    fair, a, b = _two_active(40, 900)
    fair.arrive(_req("a"))
    assert fair.key(a) == 40 < fair.key(b)


def test_a_returning_tenant_keeps_what_it_was_served_above_the_class_time():
    """Coming back raises a counter to the class's time, never lowers it: a tenant that was
    served more than the others before it paused is not forgiven by pausing."""
    fair, a, _ = _two_active(5000, 100)
    fair.leave(a)
    fair.arrive(a)
    assert fair.key(a) == 5000


def test_a_class_time_comes_from_its_own_tenants_only():
    """A standard tenant's starting point is set by standard tenants, not by premium ones that
    were served far more."""
    fair = FairShare()
    gold = _req("gold", qos="premium")
    fair.arrive(gold)
    fair.charge(gold, 10_000)
    a = _req("a")
    fair.arrive(a)
    fair.charge(a, 50)
    fair.arrive(_req("b"))
    assert fair.key(_req("b")) == 50


def test_a_tenant_is_active_until_its_last_request_leaves():
    """While one of its requests is unfinished a tenant keeps its counter when it sends more;
    once the last leaves, its low counter no longer holds back the class's time, so a tenant
    arriving then starts level with the active ones."""
    fair, a, b = _two_active(40, 900)
    fair.arrive(a)                                    # a second request
    fair.leave(a)                                     # one left: a is still active
    fair.arrive(a)
    assert fair.key(a) == 40
    fair.leave(a)
    fair.leave(a)                                     # the last one left: a is idle
    c = _req("c")
    fair.arrive(c)
    assert fair.key(c) == 900


def test_an_arriving_tenant_starts_level_with_the_least_served_active_one():
    """Not at the most served: it would wait behind every active tenant; not at 0: it would
    overtake them all."""
    fair, _, _ = _two_active(5000, 100)
    c = _req("c")
    fair.arrive(c)
    assert fair.key(c) == 100


def test_quiet_tenants_do_not_hold_back_the_class_time():
    """``c`` went quiet long ago at 40 and ``b`` at 100; ``a`` was served on to 5000. ``b``
    comes back at 5000: an idle tenant's old counter does not count toward the class time."""
    fair = FairShare()
    a, b, c = _req("a"), _req("b"), _req("c")
    for req, served in ((a, 0), (b, 100), (c, 40)):
        fair.arrive(req)
        fair.charge(req, served)
    fair.leave(c)
    fair.leave(b)
    fair.charge(a, 5000)
    fair.arrive(b)
    assert fair.key(b) == 5000


def _victim(ref_cnts: list[int], computed: int) -> SimpleNamespace:
    blocks = [SimpleNamespace(ref_cnt=n) for n in ref_cnts]
    return SimpleNamespace(blocks=blocks, num_computed_tokens=computed, priority=0, arrival_seq=0)


def test_lost_work_counts_only_the_leading_shared_blocks_as_kept():
    """A shared block after a private one is no prefix hit on recompute: only the leading run
    of blocks another holder keeps is saved."""
    policy = PreemptionPolicy(block_size=16)
    assert policy.lost_tokens(_victim([2, 2, 1, 2, 1], 75)) == 75 - 32
    assert policy.lost_tokens(_victim([1, 3, 3], 48)) == 48


def test_auto_swaps_only_when_the_lost_work_is_large_in_blocks_and_in_share():
    policy = PreemptionPolicy(mode="auto", block_size=16, min_swap_blocks=2)
    assert policy.should_swap(_victim([1, 1, 1], 48))                  # 48 lost of 48
    assert not policy.should_swap(_victim([2, 2, 2, 2, 1, 1], 96))     # 32 lost of 96: a third
    assert not policy.should_swap(_victim([1, 1], 20))                 # 20 lost: under 2 blocks
    assert not policy.should_swap(_victim([2, 2, 1, 1], 64))           # 32 lost of 64: half
    assert not policy.should_swap(_victim([2, 2, 2, 1, 1], 80))        # 32 lost of 80: 40%


def test_auto_as_the_engine_builds_it_swaps_from_two_lost_blocks():
    policy = PreemptionPolicy("auto", 16)
    assert policy.should_swap(_victim([1, 1], 32))                     # 2 blocks lost of 2
    assert not policy.should_swap(_victim([1, 1], 31))


def test_lost_work_never_counts_blocks_past_the_computed_tokens_as_kept():
    """A shared block the victim has not filled (a fork's partial tail) saves only what is in
    its full computed blocks."""
    policy = PreemptionPolicy(block_size=16)
    assert policy.lost_tokens(_victim([2, 2], 20)) == 4
    assert policy.lost_tokens(_victim([3, 3, 3], 16)) == 0
