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
