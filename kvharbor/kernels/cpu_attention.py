"""Exact paged attention for the CPU: one plan per step, SDPA per group of sequences.

The reference (:mod:`kvharbor.kernels.reference`) re-derives its batch from tensors in every
layer, gathers whole blocks padded to the longest sequence and zeroes the padding. Here the
host-side work happens once per step (:func:`plan_attention`), shared by all layers:

* decode rows (one query) are sorted by K/V length and cut into groups of ``DECODE_GROUP``;
  a group gathers exactly the key slots its sequences need, padded to the group's longest
  with the sequence's own *first visible* slot (written, so finite; masked), and runs one SDPA
  with the GQA query heads of a KV head as rows (``[B, Hkv, G, D]``), so K/V are never repeated;
* a prefill with no earlier K/V (``kv_len == q_len``) attends over this step's own K/V rows
  (no cache read), causal; other prefills gather their slots once and use a mask built once.

Keys outside a sliding window are not gathered at all (decode) or masked (prefill).
Same math as the reference (masked softmax in the query dtype via SDPA); outputs match it to
float rounding, which the kernel tests bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reference import dequantize_kv, quantize_kv

DECODE_GROUP = 16


@dataclass(slots=True)
class DecodeGroup:
    """Single-query sequences attended together: ``slots`` ``[B, L]`` int64 (padding repeats
    the first visible slot), ``mask`` ``[B, 1, 1, L]`` bool, ``rows`` ``[B]`` query rows."""

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass(slots=True)
class PrefillSeq:
    """Query rows ``[qs, qe)`` of one sequence; ``slots`` ``[K]`` and ``mask`` ``[Q, K]`` are None
    for a fresh causal prefill (its K/V are this step's rows ``[qs, qe)``)."""

    qs: int
    qe: int
    slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionPlan:
    decode: list[DecodeGroup]
    prefill: list[PrefillSeq]


def plan_attention(block_tables: torch.Tensor, seq_lens: list[int], query_start_loc: list[int],
                   block_size: int, sliding_window: int | None = None,
                   use_new_kv: bool = True) -> AttentionPlan:
    """Build the step's plan from host lists (``seq_lens`` ``[B]``, ``query_start_loc`` ``[B+1]``)
    and the block table tensor ``[B, max_blocks]`` (on the device of the cache).

    ``use_new_kv=False`` (quantized caches) makes fresh prefills read the cache like every
    other query, so all queries see the same (quantized) keys and values."""
    dev = block_tables.device
    decode, prefill = [], []
    for b, kv_len in enumerate(seq_lens):
        qs, qe = query_start_loc[b], query_start_loc[b + 1]
        if qe - qs == 1:
            decode.append(b)
        elif qe > qs:
            prefill.append(_plan_prefill(block_tables[b], kv_len, qs, qe, block_size, sliding_window,
                                         use_new_kv))
    decode.sort(key=lambda b: seq_lens[b])
    groups = []
    for i in range(0, len(decode), DECODE_GROUP):
        members = decode[i:i + DECODE_GROUP]
        groups.append(_plan_decode(block_tables, seq_lens, query_start_loc, members, block_size,
                                   sliding_window, dev))
    return AttentionPlan(groups, prefill)


def _visible_start(kv_len: int, sliding_window: int | None) -> int:
    """First key position the last query (at ``kv_len - 1``) may see."""
    return max(0, kv_len - sliding_window) if sliding_window else 0


def _plan_decode(block_tables, seq_lens, qsl, members, bs, sliding_window, dev) -> DecodeGroup:
    starts = [_visible_start(seq_lens[b], sliding_window) for b in members]
    counts = [seq_lens[b] - s for b, s in zip(members, starts)]
    width = max(counts)
    idx = torch.tensor(members, device=dev)
    start = torch.tensor(starts, device=dev)[:, None]
    count = torch.tensor(counts, device=dev)[:, None]
    offs = torch.arange(width, device=dev)[None, :]
    mask = offs < count                                              # [B, L]
    pos = start + torch.where(mask, offs, 0)                         # padding -> first visible
    table = block_tables[idx].long()
    slots = table.gather(1, pos // bs) * bs + pos % bs
    rows = torch.tensor([qsl[b] for b in members], device=dev)
    return DecodeGroup(rows, slots, mask[:, None, None, :])


def _plan_prefill(table_row, kv_len, qs, qe, bs, sliding_window, use_new_kv) -> PrefillSeq:
    q_len = qe - qs
    if use_new_kv and q_len == kv_len and (not sliding_window or sliding_window >= kv_len):
        return PrefillSeq(qs, qe, None, None)
    dev = table_row.device
    k_pos = torch.arange(kv_len, device=dev)
    slots = table_row.long()[k_pos // bs] * bs + k_pos % bs
    q_pos = torch.arange(kv_len - q_len, kv_len, device=dev)[:, None]
    mask = k_pos[None, :] <= q_pos
    if sliding_window:
        mask &= k_pos[None, :] > q_pos - sliding_window
    return PrefillSeq(qs, qe, slots, mask)


def _rows(cache: torch.Tensor, slots: torch.Tensor, scale, dtype) -> torch.Tensor:
    """Cache rows at ``slots`` (any shape ``S``): ``[*S, Hkv, D]`` in ``dtype``."""
    n, bs, hkv, d = cache.shape
    flat = cache.view(n * bs, hkv, d).index_select(0, slots.reshape(-1))
    return dequantize_kv(flat, scale, dtype).view(*slots.shape, hkv, d)


def paged_attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache,
                        plan: AttentionPlan, scale: float) -> torch.Tensor:
    """Attention of the flattened step (this step's K/V already stored in ``cache``).

    Args:
        query: ``[H, T, D]`` (a view; any strides).
        key, value: this step's ``[Hkv, T, D]`` (used by fresh prefills only).
        cache: a ``LayerKVCache``.
    Returns:
        ``[T, H, D]`` in ``query.dtype``.
    """
    h, t, d = query.shape
    hkv = key.shape[0]
    out = torch.empty(t, h, d, dtype=query.dtype, device=query.device)
    for g in plan.decode:
        q = query.index_select(1, g.rows).transpose(0, 1).reshape(-1, hkv, h // hkv, d)
        k = _rows(cache.key, g.slots, cache.k_scale, query.dtype).transpose(1, 2)
        v = _rows(cache.value, g.slots, cache.v_scale, query.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
        out.index_copy_(0, g.rows, o.reshape(-1, h, d))
    for p in plan.prefill:
        q = query[:, p.qs:p.qe]
        if p.slots is None:
            o = F.scaled_dot_product_attention(q, key[:, p.qs:p.qe], value[:, p.qs:p.qe],
                                               is_causal=True, scale=scale, enable_gqa=h != hkv)
        else:
            k = _rows(cache.key, p.slots, cache.k_scale, query.dtype).transpose(0, 1)
            v = _rows(cache.value, p.slots, cache.v_scale, query.dtype).transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=scale,
                                               enable_gqa=h != hkv)
        out[p.qs:p.qe] = o.transpose(0, 1)
    return out


def store_kv_cpu(key: torch.Tensor, value: torch.Tensor, cache, slot_mapping: torch.Tensor) -> None:
    """Write this step's ``key``/``value`` ``[T, Hkv, D]`` (any strides) at ``slot_mapping``
    ``[T]`` (int64, every slot valid: no padding)."""
    n, bs, hkv, d = cache.key.shape
    cache.key.view(n * bs, hkv, d).index_copy_(0, slot_mapping, quantize_kv(key, cache.k_scale, cache.key.dtype))
    cache.value.view(n * bs, hkv, d).index_copy_(0, slot_mapping,
                                                 quantize_kv(value, cache.v_scale, cache.value.dtype))
