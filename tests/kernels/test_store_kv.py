"""Triton ``store_kv`` writes exactly the bytes the torch reference writes."""

from __future__ import annotations

import pytest
import torch

from kvharbor.kernels.reference import store_kv_ref
from kvharbor.kernels.store_kv import store_kv

from .batch import DEVICE, empty_cache


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so NaN == NaN and -0 != +0 (bit-exact comparison)."""
    return x.contiguous().view(torch.uint8)


def _store_both(key, value, slots, cache_shape, cache_dtype, k_scale=None, v_scale=None):
    """Store through both implementations into identically poisoned caches (on ``DEVICE``)."""
    key, value, slots = key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE)
    k_scale = k_scale.to(DEVICE) if k_scale is not None else None
    v_scale = v_scale.to(DEVICE) if v_scale is not None else None
    caches = [[empty_cache(*cache_shape, cache_dtype, poison=True) for _ in range(2)]
              for _ in range(2)]
    store_kv(key, value, *caches[0], slots, k_scale, v_scale)
    store_kv_ref(key, value, *caches[1], slots, k_scale, v_scale)
    return caches[0], caches[1]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16,
                                         torch.int8, torch.float8_e4m3fn])
def test_store_matches_reference_bit_for_bit(cache_dtype):
    """Every dtype, negative (skipped) slots, block size 16, K/V as strided views of a QKV."""
    g = torch.Generator().manual_seed(0)
    t, hkv, d, n, bs = 37, 2, 32, 6, 16
    src_dtype = cache_dtype if cache_dtype.itemsize > 1 else torch.float16
    qkv = (torch.randn(t, 3, hkv, d, generator=g) * 4).to(src_dtype)
    key, value = qkv[:, 1], qkv[:, 2]                      # non-contiguous rows
    slots = torch.randperm(n * bs, generator=g)[:t]
    slots[::5] = -1
    scales = (torch.tensor([0.03, 0.05]), torch.tensor([0.02, 0.04])) \
        if cache_dtype.itemsize == 1 else (None, None)
    (tk, tv), (rk, rv) = _store_both(key, value, slots, (n, bs, hkv, d), cache_dtype, *scales)
    assert torch.equal(_bytes(tk), _bytes(rk)) and torch.equal(_bytes(tv), _bytes(rv))
    untouched = torch.ones(n * bs, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0].to(DEVICE)] = False
    poison = empty_cache(n, bs, hkv, d, cache_dtype, poison=True).view(n * bs, hkv, d)
    for cache in (tk, tv):
        assert torch.equal(_bytes(cache.view(n * bs, hkv, d)[untouched]),
                           _bytes(poison[untouched])), "a skipped or unused slot was written"


def test_int8_rounds_half_to_even_and_saturates():
    """Ties go to even like torch.round; |x / scale| > 127 clamps to +-127."""
    vals = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 300.0, -300.0, 0.49,
                         -0.51, 3.0, 7.5, -7.5, 0.0, 127.4])
    key = vals.view(1, 1, 16).repeat(2, 1, 1)
    slots = torch.tensor([0, 1])
    (tk, _), (rk, _) = _store_both(key, key, slots, (1, 2, 1, 16), torch.int8,
                                   torch.ones(1), torch.ones(1))
    assert tk[0, 0, 0].tolist() == [0, 2, 2, 0, -2, -2, 126, 127, -127, 0, -1, 3, 8, -8, 0, 127]
    assert torch.equal(tk, rk)


def test_fp8_rounding_carries_into_the_exponent():
    """Values just below a power of two round up to it (e.g. 126.6 -> 128); +-448 saturates."""
    vals = torch.tensor([126.6, 31.9, -62.5, 0.0019, 1e-4, 500.0, -1e4, 17.0, 19.0, 240.5,
                         -0.0, 2.0**-9 * 1.5, 1.0625, 1.1875, 447.0, 3.3])
    key = vals.view(1, 1, 16)
    (tk, _), (rk, _) = _store_both(key, key, torch.tensor([0]), (1, 1, 1, 16),
                                   torch.float8_e4m3fn, torch.ones(1), torch.ones(1))
    assert tk[0, 0, 0, :2].float().tolist() == [128.0, 32.0]
    assert tk[0, 0, 0, 5].float().item() == 448.0 and tk[0, 0, 0, 6].float().item() == -448.0
    assert torch.equal(_bytes(tk), _bytes(rk))


def test_fp8_ties_between_all_neighbouring_values_round_to_even():
    """Midpoints of every pair of adjacent finite e4m3 values (+ and -) match torch exactly."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0..448
    mids = (grid[:-1] + grid[1:]) / 2
    vals = torch.cat([mids, -mids, torch.zeros(256 - 2 * mids.numel())]).view(16, 1, 16)
    slots = torch.arange(16)
    (tk, _), (rk, _) = _store_both(vals, vals, slots, (1, 16, 1, 16), torch.float8_e4m3fn,
                                   torch.ones(1), torch.ones(1))
    assert torch.equal(_bytes(tk), _bytes(rk))


def test_store_to_slots_past_int32_element_offsets():
    """A [2**20 + 8, 32, 1, 64] int8 cache: slots in blocks >= 2**20 lie past element 2**31."""
    n, bs, d = 2**20 + 8, 32, 64
    cache = [torch.empty(n, bs, 1, d, dtype=torch.int8, device=DEVICE) for _ in range(2)]
    key = torch.randn(3, 1, d, device=DEVICE)
    slots = torch.tensor([(n - 1) * bs + 31, 2**20 * bs, (n - 3) * bs + 5], device=DEVICE)
    scale = torch.full((1,), 0.05, device=DEVICE)
    store_kv(key, -key, *cache, slots, scale, scale)
    flat = cache[0].view(n * bs, 1, d)
    expected = (key / 0.05).round().clamp(-127, 127).to(torch.int8)
    assert torch.equal(flat[slots], expected)
    assert torch.equal(cache[1].view(n * bs, 1, d)[slots], -expected)


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(slots=a["slots"].int()), "slot_mapping must be int64"),
    (lambda a: a.update(k_scale=None), "needs k_scale"),
    (lambda a: a.update(key=a["key"][:, :, :8], value=a["key"][:, :, :8]), "do not match cache"),
    (lambda a: a.update(k_scale=a["k_scale"].double()), "scales must be contiguous float32"),
])
def test_store_rejects_bad_inputs(mutate, message):
    """Mistakes in the call fail before launch, naming what is wrong."""
    key = torch.randn(2, 1, 16, device=DEVICE)
    args = dict(key=key, value=key, slots=torch.tensor([0, 1], device=DEVICE),
                k_scale=torch.ones(1, device=DEVICE), v_scale=torch.ones(1, device=DEVICE))
    mutate(args)
    cache = [torch.zeros(1, 2, 1, 16, dtype=torch.int8, device=DEVICE) for _ in range(2)]
    with pytest.raises(AssertionError, match=message):
        store_kv(args["key"], args["value"], *cache, args["slots"], args["k_scale"],
                 args["v_scale"])
