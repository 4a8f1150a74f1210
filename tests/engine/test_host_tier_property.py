"""Property test: random requests over a small device pool and host tier keep both sound, and
every block reused from the device or copied back from host memory holds its own K/V."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.engine.block_pool import BlockPool
from kvharbor.engine.host_pool import HostKVPool
from kvharbor.engine.kv_cache_manager import KVCacheManager
from kvharbor.engine.kv_transfer import KVTransfer
from kvharbor.engine.request import Request, SamplingParams
from kvharbor.kernels import LayerKVCache

BS, DEVICE_BLOCKS, HOST_SLOTS = 4, 8, 6
OPS = st.lists(st.tuples(st.sampled_from(["new", "free"]), st.integers(0, 5),
                         st.integers(2, 28)), min_size=4, max_size=50)


def _stamp(block_hash: bytes) -> float:
    return float(int.from_bytes(block_hash[:3], "little"))


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_host_tier_keeps_contents_and_integrity(ops):
    pool = BlockPool(DEVICE_BLOCKS)
    shape = (DEVICE_BLOCKS + 1, BS, 1, 1)
    caches = [LayerKVCache(torch.zeros(shape), torch.zeros(shape))]
    host = HostKVPool(HOST_SLOTS, (1, 2, BS, 1, 1), torch.float32)
    transfer = KVTransfer(host, caches)
    pool.on_evict = transfer.on_evict
    kv = KVCacheManager(pool, BS, host, transfer)
    live: dict[int, Request] = {}
    for op, key, n in ops:
        if op == "new" and key not in live:
            family = [(key % 3) * 10 + j % 3 for j in range(n)]          # 3 prefix families
            req = Request(f"r{key}", family + [key], SamplingParams())
            hit = kv.get_computed_blocks(req)
            if not kv.can_allocate(req, req.num_tokens - hit.num_tokens, hit):
                continue
            kv.allocate(req, req.num_tokens - hit.num_tokens, hit)
            transfer.flush()                      # the step boundary
            reused = req.num_computed_tokens // BS
            for i in range(reused):               # device hits and host loads hold their K/V
                assert caches[0].key[req.blocks[i].block_id, 0, 0, 0] == _stamp(req.block_hashes[i])
            for i in range(reused, len(req.block_hashes)):     # "compute" the rest
                caches[0].key[req.blocks[i].block_id] = _stamp(req.block_hashes[i])
            req.num_computed_tokens = req.num_tokens
            kv.cache_full_blocks(req)
            live[key] = req
        elif op == "free" and key in live:
            kv.free(live.pop(key))
        pool.check_integrity()
        host.check_integrity()
    assert host.num_used <= HOST_SLOTS
