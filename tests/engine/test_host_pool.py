"""Host tier bookkeeping and the preemption policy, without a model."""

from __future__ import annotations

import pytest
import torch

from kvharbor.engine.block_pool import BlockPool
from kvharbor.engine.hashing import BlockHash
from kvharbor.engine.host_pool import HostKVPool
from kvharbor.engine.kv_cache_manager import KVCacheManager
from kvharbor.engine.kv_transfer import KVTransfer
from kvharbor.engine.preemption import PreemptionPolicy
from kvharbor.engine.request import Request, SamplingParams
from kvharbor.kernels import LayerKVCache


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def _caches() -> list[LayerKVCache]:
    """One layer of 4 device blocks of 2 slots: keys 0..7, values 100..107."""
    return [LayerKVCache(torch.arange(8.0).view(4, 2, 1, 1), torch.arange(8.0).view(4, 2, 1, 1) + 100)]


def _pool(n: int) -> HostKVPool:
    return HostKVPool(n, (1, 2, 2, 1, 1), torch.float32)


def test_host_pool_is_lru_bounded_and_reports_events():
    host = _pool(3)
    for i in range(3):
        assert host.reserve(_h(i)) is not None
    assert host.reserve(_h(0)) is None            # already held: becomes most recent
    assert host.reserve(_h(3)) is not None        # drops the least recent: h1
    assert host.lookup(_h(1)) is None and host.lookup(_h(0)) is not None
    # Netted: h1 was stored and dropped since the last drain, so it is only "removed".
    assert host.drain_events() == ([_h(0), _h(2), _h(3)], [_h(1)])
    assert host.num_used == 3
    host.check_integrity()


def _corrupt(how: str) -> HostKVPool:
    """A 3-slot pool holding h0, then broken as ``how`` says."""
    host = _pool(3)
    slot = host.reserve(_h(0))
    if how == "lost":
        host.free.pop()
    elif how == "freed twice":                    # h0's slot forgotten, another listed twice
        del host.cached[_h(0)], host.slot_hash[slot]
        host.free.append(host.free[0])
    elif how == "free and cached":                # a free slot replaced by h0's
        host.free.pop()
        host.free.append(slot)
    elif how == "maps disagree":
        host.slot_hash[slot] = _h(5)
    elif how == "lock on a free slot":
        host.locks[host.free[0]] = 1
    return host


@pytest.mark.parametrize("how, says", [("lost", "host slot lost"), ("freed twice", "host slot freed twice"),
                                       ("free and cached", "host slot both free and cached"),
                                       ("maps disagree", "host maps disagree"),
                                       ("lock on a free slot", "lock on a slot that is not cached")])
def test_check_integrity_catches_each_broken_invariant(how, says):
    _pool(3).check_integrity()
    with pytest.raises(AssertionError, match=says):
        _corrupt(how).check_integrity()


@pytest.mark.parametrize("slots", [0, -1])
def test_a_host_tier_of_no_slots_is_refused_naming_the_setting(slots):
    with pytest.raises(ValueError, match="host_kv_blocks must be positive"):
        _pool(slots)


def test_locked_and_owned_slots_are_never_reused():
    host = _pool(3)
    slots = [host.reserve(_h(i)) for i in range(3)]
    host.lock(slots[0])
    owned = host.take_owned(2)                    # drops h1, h2; h0 is locked
    assert owned is not None and host.lookup(_h(0)) == slots[0]
    assert host.take_owned(1) is None and host.reserve(_h(9)) is None
    host.check_integrity()                        # owned slots are counted, not lost
    host.unlock(slots[0])
    host.release_owned(owned)
    assert host.num_available() == 3
    host.check_integrity()


def test_a_slot_locked_twice_stays_locked_until_both_copies_are_done():
    """Two pending copies of one block (two requests hit it in one step): the first copy done
    leaves the slot locked for the second; only then may it be dropped."""
    host = _pool(1)
    slot = host.reserve(_h(0))
    host.lock(slot)
    host.lock(slot)
    host.unlock(slot)
    assert host.reserve(_h(1)) is None and host.lookup(_h(0)) == slot
    host.unlock(slot)
    assert host.reserve(_h(1)) == slot
    host.check_integrity()


def test_a_block_loaded_back_becomes_the_most_recent():
    """A host hit (its slot locked for the copy back) is fresh for the LRU: the next slot
    needed drops an older block, not the one just used."""
    host = _pool(2)
    first = host.reserve(_h(0))
    host.reserve(_h(1))
    host.lock(first)
    host.unlock(first)
    host.reserve(_h(2))
    assert host.lookup(_h(0)) == first and host.lookup(_h(1)) is None
    host.check_integrity()


def test_a_flush_drops_every_unlocked_block_and_reports_it():
    """``drop_all_cached`` (a cache flush) keeps a block whose copy is pending, and each block
    it drops is a "removed" event, so the routers' indexes forget it."""
    host = _pool(3)
    slots = [host.reserve(_h(i)) for i in range(3)]
    host.drain_events()
    host.lock(slots[1])
    assert host.drop_all_cached() == 2
    assert host.lookup(_h(1)) == slots[1] and host.lookup(_h(0)) is None
    assert host.drain_events() == ([], [_h(0), _h(2)])
    host.check_integrity()


def test_transfer_saves_before_it_loads():
    """A block reused in the same step is saved before a load overwrites it."""
    caches = _caches()
    host = HostKVPool(4, (1, 2, 2, 1, 1), torch.float32)
    t = KVTransfer(host, caches)
    src = host.reserve(_h(7))
    host.data[src] = -1.0
    t.on_evict(2, _h(5))                          # block 2 (values 4, 5) is evicted ...
    t.load(src, 2, owned=False)                   # ... and reused for a host hit
    t.flush()
    saved = host.lookup(_h(5))
    assert host.data[saved, 0, 0].flatten().tolist() == [4.0, 5.0]
    assert host.data[saved, 0, 1].flatten().tolist() == [104.0, 105.0]
    assert caches[0].key[2].flatten().tolist() == [-1.0, -1.0]
    assert not host.locks
    host.check_integrity()


def test_a_flush_copies_each_recorded_block_once():
    """After a flush nothing is pending: a later flush does not save an evicted block again.
    (Saved again once its host copy was dropped, it would store whatever the device block
    holds by then under the old hash.)"""
    caches = _caches()
    host = HostKVPool(1, (1, 2, 2, 1, 1), torch.float32)
    t = KVTransfer(host, caches)
    t.on_evict(1, _h(5))
    t.flush()
    assert t.blocks_to_host == 1 and not t.pending
    assert host.reserve(_h(6)) is not None        # the only slot now holds h6: h5 dropped
    caches[0].key[1] = -7.0                       # block 1 reused for other tokens
    t.flush()
    assert t.blocks_to_host == 1 and host.lookup(_h(5)) is None
    host.check_integrity()


def _running(rid: str, blocks, computed: int, priority: int = 0, seq: int = 0) -> Request:
    req = Request(rid, [1] * (computed + 1), SamplingParams(), priority=priority, arrival_seq=seq)
    req.blocks, req.num_computed_tokens = blocks, computed
    return req


def test_victim_loses_least_work_within_its_class():
    pool = BlockPool(24)
    shared = pool.allocate(4, False)
    pool.touch(shared)                            # held by another request too
    a = _running("a", shared + pool.allocate(1, False), 70, seq=1)      # loses 6 tokens
    b = _running("b", pool.allocate(5, False), 70, seq=2)              # loses 70
    c = _running("c", pool.allocate(5, False), 70, priority=-1, seq=0)  # lower class
    policy = PreemptionPolicy("auto", 16)
    assert policy.lost_tokens(a) == 6 and policy.lost_tokens(b) == 70
    assert policy.choose_victim([a, b, c]) is c
    assert policy.choose_victim([a, b]) is a
    assert policy.should_swap(b) and not policy.should_swap(a)
    assert not PreemptionPolicy("recompute", 16).should_swap(b)
    assert PreemptionPolicy("swap", 16).should_swap(a)
    d = _running("d", pool.allocate(5, False), 70, seq=3)               # loses 70, came last
    assert policy.choose_victim([b, d]) is d and policy.choose_victim([d, b]) is d


def test_a_host_hit_dropped_before_it_is_loaded_is_cut_there():
    """A swap-out while the scheduler makes room (after the lookup) can drop a host copy the
    hit counted on: the hit ends before that block, so the request computes it again instead
    of loading whatever the slot holds by then."""
    host = HostKVPool(4, (1, 2, 2, 1, 1), torch.float32)
    transfer = KVTransfer(host, _caches())
    kv = KVCacheManager(BlockPool(4), 2, host, transfer)
    req = Request("r", list(range(1, 8)), SamplingParams())         # 3 full blocks may hit
    req.update_block_hashes(2)
    slots = [host.reserve(h) for h in req.block_hashes[:3]]
    host.reserve(req.block_hashes[0])             # block 0 most recent: LRU is 1, 2, 0
    hit = kv.get_computed_blocks(req)
    assert hit.host_slots == slots and hit.num_tokens == 6
    owned = host.take_owned(2)                    # a victim's swap-out: the free slot and block 1's
    assert owned is not None and host.lookup(req.block_hashes[1]) is None
    kv.allocate(req, 1, hit)
    assert req.num_computed_tokens == 2 and len(req.blocks) == 2     # block 0 loaded; 1 to compute
    assert [slot for slot, _ in transfer.loads] == [slots[0]] and host.locks == {slots[0]: 1}
    host.release_owned(owned)
    transfer.flush()
    host.check_integrity()
