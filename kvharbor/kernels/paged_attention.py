"""Triton paged attention over the flattened batch (prefills with cached prefixes + decodes).

Work split. A *query tile* is ``BLOCK_Q`` consecutive query tokens of one sequence times the
``GROUP = Hq // Hkv`` query heads that share one KV head, packed into ``BLOCK_M`` rows::

    row r  ->  token q0 + r // GROUP_PAD,  query head kvh * GROUP + r % GROUP_PAD

so every K/V tile loaded from the cache serves all heads of its group (GQA/MQA for free).
Sequence ``b`` owns tiles ``qsl[b] // BLOCK_Q + b .. + cdiv(q_len_b, BLOCK_Q) - 1``; these
start indices strictly increase with ``b``, so a program finds its sequence by binary search
and the grid, ``T // BLOCK_Q + B`` tiles, needs no host sync. Spare tiles exit at once.

Per program (tile, kv head, split): keys ``[lo, hi)`` where ``hi`` is one past the tile's last
query position and ``lo`` is 0 or the window start of its first query; split-K (flash
decoding) cuts ``[lo, hi)`` into ``NUM_SPLITS`` chunks whose normalised partial outputs and
base-2 log-sum-exps :func:`_reduce_splits_kernel` merges. Online softmax runs in fp32 with
exp2. Quantized caches are read as int8/fp8 and dequantized in registers: the per-head
``k_scale`` folds into the softmax scale, ``v_scale`` into the output. Cache offsets are
``int64(block_id) * stride``, safe for any number of blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .store_kv import QUANT_NONE, check_cache

QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _paged_attn_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_ptr, seq_lens_ptr,
        qsl_ptr, out_ptr, lse_ptr, sm_scale, num_seqs, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
        stride_cb, stride_cs, stride_ch, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, NUM_SPLITS: tl.constexpr,
        USE_WINDOW: tl.constexpr, FP32_DOT: tl.constexpr, DOT_UPCAST: tl.constexpr,
        DECODE_ONLY: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:
        # One query token per sequence: tile b is sequence b's token b. No search, no loads
        # of query_start_loc: at short contexts those dependent loads were most of a program.
        b = tile
        q_begin = tile
        q_len = tile * 0 + 1
        q0 = tile * 0
    else:
        # Binary search: the largest b with qsl[b] // BLOCK_Q + b <= tile. (Helpers are
        # inlined in this kernel: each nested @triton.jit call costs ~5 ms under the
        # interpreter.)
        b = 0
        b_hi = num_seqs - 1
        while b < b_hi:
            mid = (b + b_hi + 1) // 2
            if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile:
                b = mid
            else:
                b_hi = mid - 1
        q_begin = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_begin
        q0 = (tile - (q_begin // BLOCK_Q + b)) * BLOCK_Q
    if q0 < q_len:
        kv_len = tl.load(seq_lens_ptr + b)
        ctx = kv_len - q_len                                   # cached prefix length
        offs_m = tl.arange(0, BLOCK_M)
        q_idx = q0 + offs_m // GROUP_PAD                       # [M] token within sequence
        g = offs_m % GROUP_PAD
        row_ok = (q_idx < q_len) & (g < GROUP)
        head = kvh * GROUP + g                                 # [M] query head
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q_rows = (q_begin + q_idx).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = ctx + q_idx                                    # [M] absolute position

        hi = tl.minimum(kv_len, ctx + tl.minimum(q0 + BLOCK_Q, q_len))
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(ctx + q0 - window + 1, 0)
        if NUM_SPLITS > 1:
            chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = lo + split * chunk
            hi = tl.minimum(hi, lo + chunk)

        qk_scale = sm_scale * 1.4426950408889634               # log2(e): softmax via exp2
        if QUANT != 0:
            qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        for start in range(lo, hi, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)              # [N] key positions
            k_ok = k_pos < hi
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            kv_off = blk * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
            k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None],
                        mask=k_ok[None, :] & d_ok[:, None], other=0.0).to(q.dtype)  # [D, N]
            # fp32: exact products (no TF32). DOT_UPCAST only under the interpreter, whose
            # tl.dot multiplies the raw uint16 bits of bf16 values (Triton 3.9).
            if DOT_UPCAST:
                s = tl.dot(q.to(tl.float32), k.to(tl.float32))
            elif FP32_DOT:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :],
                        mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # [N, D]
            if DOT_UPCAST:
                pv = tl.dot(p.to(q.dtype).to(tl.float32), v.to(tl.float32))
            elif FP32_DOT:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(q.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if QUANT != 0:
            o = o * tl.load(v_scale_ptr + kvh)
        o_mask = row_ok[:, None] & d_ok[None, :]
        o_off = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            tl.store(out_ptr + o_off + split * stride_os, o, mask=o_mask)
            lse = tl.where(l_i == 0.0, float("-inf"),
                           m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(lse_ptr + q_rows * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _reduce_splits_kernel(part_ptr, lse_ptr, out_ptr,
                          stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                          stride_ot, stride_oh,
                          NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, h] = sum_s w_s * part[t, h, s] / sum_s w_s with w_s = 2 ** lse[t, h, s]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + t * stride_lt + h * stride_lh + offs_s, mask=s_ok,
                  other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)                                     # 0 for empty splits
    part = tl.load(part_ptr + t * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps
                   + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=d_ok)


INTERPRETED = isinstance(_paged_attn_kernel, InterpretedFunction)
"""True when ``TRITON_INTERPRET=1`` was set before this module was imported."""


def _check_batch(query, key_cache, block_tables, seq_lens, query_start_loc, sliding_window):
    """Assert the flattened-batch metadata (see :mod:`kvharbor.kernels.reference`)."""
    assert query.dim() == 3, f"query must be [T, H, D], got {tuple(query.shape)}"
    assert query.dtype in QUERY_DTYPES, f"query dtype must be fp32/fp16/bf16, got {query.dtype}"
    assert query.stride(2) == 1, "query head_dim must be contiguous"
    t, h, d = query.shape
    hkv = key_cache.shape[2]
    assert d == key_cache.shape[3], f"query head_dim {d} != cache head_dim {key_cache.shape[3]}"
    assert d >= 16, f"head_dim must be >= 16 for tl.dot, got {d}"
    assert h % hkv == 0, f"query heads {h} must be a multiple of KV heads {hkv}"
    assert block_tables.dim() == 2 and block_tables.dtype == torch.int32, \
        f"block_tables must be int32 [B, max_blocks], got {block_tables.dtype}"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    nseq = block_tables.shape[0]
    assert seq_lens.shape == (nseq,) and seq_lens.dtype == torch.int32, \
        f"seq_lens must be int32 [{nseq}], got {seq_lens.dtype} {tuple(seq_lens.shape)}"
    assert query_start_loc.shape == (nseq + 1,) and query_start_loc.dtype == torch.int32, \
        f"query_start_loc must be int32 [{nseq + 1}], got {tuple(query_start_loc.shape)}"
    assert seq_lens.is_contiguous() and query_start_loc.is_contiguous()
    for x in (key_cache, block_tables, seq_lens, query_start_loc):
        assert x.device == query.device, f"all tensors must be on {query.device}, got {x.device}"
    assert sliding_window is None or sliding_window >= 0, "sliding_window must be None or >= 0"


def default_tile(num_tokens: int, num_seqs: int, group: int, head_dim: int,
                 cache_bytes: int = 2, num_splits: int = 1) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_N)``: 16-row tiles for a decode-only batch (one token each), else 64.

    A decode step over a 16-bit cache reads 128 keys per step when it is split or its heads
    are at most 64 wide, else 64: measured on an H200 (docs/benchmarks.md), 128 keys ran
    1.1-1.8x faster at those points and 15% slower unsplit at head dim 128 (batch 64). With
    the decode path: 16-19% slower unsplit at batch 56 and 64, the batches left unsplit at
    8 KV heads, though 1.14-1.44x faster unsplit at batch 8-40, which the split rule splits."""
    group_pad = triton.next_power_of_2(group)
    if num_tokens == num_seqs:
        wide = cache_bytes == 2 and (num_splits > 1 or head_dim <= 64)
        return max(1, 16 // group_pad), 128 if wide else 64
    return max(1, 64 // group_pad), 64 if head_dim <= 64 else 32


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, num_splits: int = 1,
                    block_q: int | None = None, block_n: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    decode_only: bool = False) -> torch.Tensor:
    """Triton twin of :func:`kvharbor.kernels.reference.paged_attention_ref`.

    Extra args: ``decode_only``: the caller guarantees one query token per sequence
    (``query_start_loc`` = 0, 1, ..., B; not just T == B: a batch may hold a 2-token and an
    empty sequence), so each program knows its sequence without searching for it;
    ``num_splits`` > 1 selects split-K (flash decoding) plus a reduce kernel;
    ``block_q``/``block_n`` override the tile (query tokens per tile, keys per step);
    ``num_warps``/``num_stages`` Triton's launch defaults (benchmarks/attention_kernels.py sweeps them).
    Returns ``[T, H, D]`` in ``query.dtype``.
    """
    quant = check_cache(key_cache, value_cache, k_scale, v_scale)
    _check_batch(query, key_cache, block_tables, seq_lens, query_start_loc, sliding_window)
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    t, h, d = query.shape
    nseq, hkv = block_tables.shape[0], key_cache.shape[2]
    group = h // hkv
    dq, dn = default_tile(t, nseq, group, d, key_cache.element_size(), num_splits)
    block_q, block_n = block_q or dq, block_n or dn
    group_pad = triton.next_power_of_2(group)
    assert block_q * group_pad >= 16 and block_n >= 16, \
        f"tl.dot needs >= 16 rows and keys per tile: block_q={block_q} x group {group_pad}, " \
        f"block_n={block_n}"
    assert triton.next_power_of_2(block_q) == block_q, f"block_q must be a power of 2: {block_q}"
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if t == 0 or nseq == 0:
        return out
    assert not decode_only or t == nseq, f"decode_only needs one token per sequence: {t} tokens, {nseq} sequences"
    grid = (nseq if decode_only else t // block_q + nseq, hkv, num_splits)
    if num_splits == 1:
        part, lse = out, out                                   # lse unused
        part_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        part = torch.empty(t, h, num_splits, d, device=query.device, dtype=torch.float32)
        lse = torch.empty(t, h, num_splits, device=query.device, dtype=torch.float32)
        part_strides = (part.stride(0), part.stride(1), part.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    _paged_attn_kernel[grid](
        query, key_cache, value_cache,
        k_scale if quant != QUANT_NONE else key_cache,           # dummies when unquantized
        v_scale if quant != QUANT_NONE else key_cache,
        block_tables, seq_lens, query_start_loc, part, lse,
        float(scale), nseq, int(sliding_window or 0),
        query.stride(0), query.stride(1), *part_strides, *lse_strides,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_SIZE=key_cache.shape[1],
        QUANT=quant, NUM_SPLITS=num_splits, USE_WINDOW=bool(sliding_window),
        FP32_DOT=query.dtype == torch.float32,
        DOT_UPCAST=query.dtype == torch.bfloat16 and INTERPRETED, DECODE_ONLY=decode_only,
        **{k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v})
    if num_splits > 1:
        _reduce_splits_kernel[(t, h)](
            part, lse, out, *part_strides, *lse_strides, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d))
    return out
