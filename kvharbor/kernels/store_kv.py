"""Triton kernel: write this step's K/V rows into their paged-cache slots.

One program per (``BLOCK_T`` tokens, KV head) copies ``[BLOCK_T, D]`` rows of K and V::

    key[t, h, :]  ──▶  key_cache[slot // bs, slot % bs, h, :]      slot = slot_mapping[t]

``slot < 0`` means "skip" (padding). For an int8 / float8_e4m3fn cache the row is divided by
the head's float32 scale and rounded exactly as :func:`kvharbor.kernels.reference.quantize_kv`
does (round half to even; fp8 saturates at +-448), so both backends store identical bytes.
Offsets into the cache are int64: ``slot * stride`` overflows int32 past 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QUANT_NONE, QUANT_INT8, QUANT_FP8 = 0, 1, 2
FP8_MAX = 448.0


@triton.jit
def _round_half_even(y):
    """``torch.round`` semantics for fp32 ``y`` with ``|y| < 2**22``."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _round_to_e4m3_grid(y):
    """Round fp32 ``y`` (``|y| <= 448``) to the nearest float8_e4m3fn value, ties to even.

    The result is exactly representable in e4m3, so the final ``.to(fp8)`` cannot round
    again. (Triton 3.9's interpreter rounds fp32 -> fp8 wrongly when the mantissa carries
    into the exponent, e.g. 126.6 -> 64; doing the rounding here sidesteps that.)
    """
    bits = y.to(tl.int32, bitcast=True)
    # e4m3: 3 mantissa bits; normals from 2**-6, subnormal quantum 2**-9.
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    quantum = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magnitude = _round_half_even(tl.abs(y) / quantum) * quantum
    sign = bits & -2147483648                    # keep -0.0 for tiny negatives, as torch does
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_rows(src_ptr, cache_ptr, scale_ptr, src_off, cache_off, head, mask,
                QUANT: tl.constexpr):
    """Copy the ``[BLOCK_T, BLOCK_D]`` tile at ``src_off`` to ``cache_off``, quantizing."""
    x = tl.load(src_ptr + src_off, mask=mask, other=0.0)
    if QUANT == 0:
        y = x
    else:
        y = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr + head))
        if QUANT == 1:
            y = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0)
        else:
            y = _round_to_e4m3_grid(tl.minimum(tl.maximum(y, -448.0), 448.0))
    tl.store(cache_ptr + cache_off, y.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                     k_scale_ptr, v_scale_ptr, num_tokens,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_T: tl.constexpr, QUANT: tl.constexpr):
    """Program (i, h): tokens ``i * BLOCK_T ..`` of KV head ``h``."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)      # [T]
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (slot >= 0)[:, None] & (offs_d < HEAD_DIM)[None, :]
    cache_off = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
                 + head * stride_ch)[:, None] + offs_d[None, :]
    _store_rows(key_ptr, key_cache_ptr, k_scale_ptr,
                (tok * stride_kt + head * stride_kh)[:, None] + offs_d[None, :],
                cache_off, head, mask, QUANT)
    _store_rows(value_ptr, value_cache_ptr, v_scale_ptr,
                (tok * stride_vt + head * stride_vh)[:, None] + offs_d[None, :],
                cache_off, head, mask, QUANT)


def quant_mode(cache_dtype: torch.dtype, k_scale: torch.Tensor | None) -> int:
    """Which in-kernel (de)quantization a cache of ``cache_dtype`` needs."""
    if cache_dtype == torch.int8:
        return QUANT_INT8
    if cache_dtype == torch.float8_e4m3fn:
        return QUANT_FP8
    if k_scale is not None:
        raise ValueError(f"k_scale/v_scale are only meaningful for int8/fp8 caches, "
                         f"got {cache_dtype}")
    return QUANT_NONE


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor,
                k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> int:
    """Assert the cache pair's layout ``[N, bs, Hkv, D]``; return its quant mode."""
    assert key_cache.dim() == 4, f"cache must be [N, bs, Hkv, D], got {tuple(key_cache.shape)}"
    assert key_cache.shape == value_cache.shape, "key and value caches differ in shape"
    assert key_cache.dtype == value_cache.dtype, "key and value caches differ in dtype"
    assert key_cache.stride() == value_cache.stride(), "key and value caches differ in strides"
    assert key_cache.stride(3) == 1, "cache head_dim must be contiguous"
    assert key_cache.device == value_cache.device
    mode = quant_mode(key_cache.dtype, k_scale)
    if mode != QUANT_NONE:
        hkv = key_cache.shape[2]
        for s in (k_scale, v_scale):
            assert s is not None, "a quantized cache needs k_scale and v_scale"
            assert s.shape == (hkv,) and s.dtype == torch.float32 and s.is_contiguous(), \
                f"scales must be contiguous float32 [{hkv}], got {tuple(s.shape)} {s.dtype}"
            assert s.device == key_cache.device
    return mode


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Triton twin of :func:`kvharbor.kernels.reference.store_kv_ref` (same arguments)."""
    mode = check_cache(key_cache, value_cache, k_scale, v_scale)
    t, hkv, d = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert (hkv, d) == tuple(key_cache.shape[2:]), \
        f"K/V rows [T, {hkv}, {d}] do not match cache heads/dim {tuple(key_cache.shape[2:])}"
    assert key.stride(2) == 1 and value.stride(2) == 1, "K/V head_dim must be contiguous"
    assert slot_mapping.shape == (t,) and slot_mapping.dtype == torch.int64, \
        f"slot_mapping must be int64 [{t}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
    assert slot_mapping.is_contiguous()
    assert key.device == key_cache.device == slot_mapping.device
    if t == 0:
        return
    block_t = min(16, triton.next_power_of_2(t))
    _store_kv_kernel[(triton.cdiv(t, block_t), hkv)](
        key, value, key_cache, value_cache, slot_mapping,
        k_scale if mode else key_cache, v_scale if mode else value_cache, t,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_T=block_t, QUANT=mode)
