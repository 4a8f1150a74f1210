"""Exact paged attention for the CPU: one plan per step, SDPA per group of sequences.

The reference (:mod:`kvharbor.kernels.reference`) re-derives its batch from tensors in every
layer, gathers whole blocks padded to the longest sequence and zeroes the padding. Here the
host-side work happens once per step (:func:`plan_attention`), shared by all layers:

* decode rows (one query) are sorted by K/V length and cut into groups of ``DECODE_GROUP``;
  a group gathers whole cache blocks (one contiguous copy per block: an order of magnitude
  faster than per-slot gathers), padded to the group's longest sequence with the null block,
  zeroes the few gathered slots a query may not see (block tails, keys before a window), and
  runs one SDPA with the GQA query heads of a KV head as rows (``[B, Hkv, G, D]``);
* a prefill with no earlier K/V (``kv_len == q_len``) attends over this step's own K/V rows
  (no cache read), causal; other prefills gather their blocks once per layer. Where the C++
  kernel of :mod:`.cpu_prefill` is built and no sliding window hides a key, both go to it
  (query blocks against key chunks up to each row's causal limit, ~1.6x SDPA's CPU flash
  kernel on a 1,024-token prompt); else SDPA, causal or with a mask built once.

Where the C++ kernel of :mod:`.cpu_decode` is built and the cache is float32, all decodes
go to it instead (one pass over the K/V bytes, read in place; ~10x faster than the groups),
and so do short queries that continue a sequence (at most ``SHORT_QUERY`` tokens after
cached ones: speculative decoding's draft verification): query ``i`` of ``q`` is a decode row
of its own over the keys up to it, so a batch of them is one kernel call, not one prefill each.

Zeroing matters: a slot past a sequence's end may hold anything (another request's stale
keys, NaN in the kernel tests), and ``0 * NaN`` would leak through a masked softmax.
Blocks wholly before a sliding window are not gathered (decode) and masked (prefill).
All SDPA inputs are 4-D: 3-D ones take PyTorch's slow math path on CPU.
Same math as the reference (masked softmax in the query dtype via SDPA); outputs match it to
float rounding, which the kernel tests bound.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import cpu_decode, cpu_ops, cpu_prefill
from .reference import dequantize_kv, float8_as_bytes, quantize_kv

DECODE_GROUP = 16
SHORT_QUERY = 17        # longest continuation query run as decode rows (16 drafts + 1)


@dataclass(slots=True)
class DecodeGroup:
    """Single-query sequences attended together over ``blocks`` ``[B, nb]`` (int64; a shorter
    sequence is padded with ``pad_block``). Gathered keys are ``[B, nb * bs]``; ``masked``
    (flat indexes into them) are zeroed after the gather, so stale or unwritten slots never
    reach the softmax; ``mask`` ``[B, 1, 1, nb * bs]`` float32 is 0 / -inf; ``rows`` ``[B]``
    are the query rows."""

    rows: torch.Tensor
    blocks: torch.Tensor
    masked: torch.Tensor
    mask: torch.Tensor


@dataclass(slots=True)
class PrefillSeq:
    """Query rows ``[qs, qe)`` of one sequence. ``blocks``/``masked``/``mask`` (``[Q, nb * bs]``)
    as for :class:`DecodeGroup`; all None for a fresh causal prefill (its K/V are this step's
    rows ``[qs, qe)``). ``past``: the keys before the first query when every query sees all
    keys up to its own (no window cuts any), else None."""

    qs: int
    qe: int
    blocks: torch.Tensor | None
    masked: torch.Tensor | None
    mask: torch.Tensor | None
    past: int | None = 0


@dataclass(slots=True)
class DecodeRows:
    """All single-query sequences for the C++ kernel (:mod:`.cpu_decode`), which reads the
    cache in place: ``rows`` ``[B]`` query rows, ``tables`` ``[B, W]``, keys
    ``[starts, lens)`` (int64)."""

    rows: torch.Tensor
    tables: torch.Tensor
    starts: torch.Tensor
    lens: torch.Tensor


@dataclass(slots=True)
class AttentionPlan:
    decode: list[DecodeGroup]
    prefill: list[PrefillSeq]
    decode_rows: DecodeRows | None = None


def plan_attention(block_tables: torch.Tensor, seq_lens: list[int], query_start_loc: list[int],
                   block_size: int, sliding_window: int | None = None,
                   use_new_kv: bool = True, pad_block: int | None = None,
                   decode_kernel: bool = False) -> AttentionPlan:
    """Build the step's plan from host lists (``seq_lens`` ``[B]``, ``query_start_loc`` ``[B+1]``)
    and the block table tensor ``[B, max_blocks]`` (on the device of the cache).

    ``use_new_kv=False`` (quantized caches) makes fresh prefills read the cache like every
    other query, so all queries see the same (quantized) keys and values. ``pad_block``: a
    block that always holds zeros (the engine's null block), used to pad short sequences
    without zeroing their padding; None pads with the table's first entry and zeroes it.
    ``decode_kernel``: plan every decode for the C++ kernel (float32 caches, kernel built)."""
    if decode_kernel:
        return _plan_for_decode_kernel(block_tables, seq_lens, query_start_loc, block_size,
                                       sliding_window, use_new_kv)
    decode, prefill = [], []
    for b, kv_len in enumerate(seq_lens):
        qs, qe = query_start_loc[b], query_start_loc[b + 1]
        if qe - qs == 1:
            decode.append(b)
        elif qe > qs:
            prefill.append(_plan_prefill(block_tables[b], kv_len, qs, qe, block_size, sliding_window,
                                         use_new_kv))
    decode.sort(key=lambda b: seq_lens[b])
    groups = [_plan_decode(block_tables, seq_lens, query_start_loc, decode[i:i + DECODE_GROUP],
                           block_size, sliding_window, pad_block)
              for i in range(0, len(decode), DECODE_GROUP)]
    return AttentionPlan(groups, prefill)


def _plan_for_decode_kernel(block_tables, seq_lens, qsl, bs, sliding_window, use_new_kv) -> AttentionPlan:
    """Every decode, and each query of every short continuation, as one row of the decode
    kernel (query ``i`` of ``q`` sees the keys up to its position, ``kv_len - q + i``).
    Array operations over the step's requests: no Python per row. Every sequence has at least
    one query row."""
    kv = np.asarray(seq_lens, dtype=np.int64)
    if qsl[-1] == len(seq_lens):                 # decodes only: request b at row b
        rows, lens, tables, prefill = np.arange(len(kv)), kv, block_tables, []
    else:
        q = np.diff(qsl)
        as_rows = (q == 1) | ((q > 1) & (q <= SHORT_QUERY) & (q < kv))
        prefill = [_plan_prefill(block_tables[b], seq_lens[b], qsl[b], qsl[b + 1], bs, sliding_window,
                                 use_new_kv)
                   for b in np.flatnonzero(~as_rows & (q > 1)).tolist()]
        if not as_rows.any():
            return AttentionPlan([], prefill)
        each = np.repeat(as_rows, q)             # per query row: run by the decode kernel?
        rows = np.flatnonzero(each)
        # Row qsl[b] + i sees kv_len - q + 1 + i keys: kv_len - qsl[b + 1] + 1 + the row.
        lens = (np.arange(qsl[-1]) + np.repeat(kv - qsl[1:] + 1, q))[each]
        tables = block_tables.index_select(0, torch.from_numpy(np.repeat(np.arange(len(q)), q)[each]))
    starts = np.maximum(lens - sliding_window, 0) if sliding_window else np.zeros_like(lens)
    rows, starts, lens = (torch.from_numpy(x) for x in (rows, starts, lens))
    return AttentionPlan([], prefill, DecodeRows(rows, tables.long(), starts, lens))


def _plan_decode(block_tables, seq_lens, qsl, members, bs, sliding_window, pad_block) -> DecodeGroup:
    dev = block_tables.device
    lens = [seq_lens[b] for b in members]
    # Whole blocks from the one holding the first visible key (sliding window) to the last.
    first = [max(0, n - sliding_window) // bs if sliding_window else 0 for n in lens]
    nblk = [-(-n // bs) - f for n, f in zip(lens, first)]
    width = max(nblk)
    cols = torch.tensor(first, device=dev)[:, None] + torch.arange(width, device=dev)[None, :]
    real = torch.arange(width, device=dev)[None, :] < torch.tensor(nblk, device=dev)[:, None]
    table = block_tables[torch.tensor(members, device=dev)].long()
    fill = table[:, :1] if pad_block is None else torch.full_like(table[:, :1], pad_block)
    blocks = torch.where(real, table.gather(1, torch.where(real, cols, 0)), fill)
    k_pos = cols.repeat_interleave(bs, 1) * bs + torch.arange(bs, device=dev).repeat(width)[None, :]
    q_pos = torch.tensor(lens, device=dev)[:, None] - 1
    allowed = k_pos <= q_pos
    if sliding_window:
        allowed &= k_pos > q_pos - sliding_window
    zero = ~allowed if pad_block is None else ~allowed & real.repeat_interleave(bs, 1)
    rows = torch.tensor([qsl[b] for b in members], device=dev)
    return DecodeGroup(rows, blocks, zero.view(-1).nonzero().view(-1), _additive(allowed)[:, None, None, :])


def _plan_prefill(table_row, kv_len, qs, qe, bs, sliding_window, use_new_kv) -> PrefillSeq:
    q_len = qe - qs
    whole = not sliding_window or sliding_window >= kv_len
    if use_new_kv and q_len == kv_len and whole:
        return PrefillSeq(qs, qe, None, None, None)
    dev = table_row.device
    nb = -(-kv_len // bs)
    k_pos = torch.arange(nb * bs, device=dev)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=dev)[:, None]
    allowed = k_pos[None, :] <= q_pos
    if sliding_window:
        allowed &= k_pos[None, :] > q_pos - sliding_window
    masked = (~allowed.any(0)).nonzero().view(-1)           # keys no query of this chunk sees
    return PrefillSeq(qs, qe, table_row[:nb].long(), masked, _additive(allowed),
                      kv_len - q_len if whole else None)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    """0 where allowed, -inf elsewhere (float32: SDPA's CPU kernels take it faster than bool;
    every row allows at least its own key, so no row is all -inf)."""
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, masked: torch.Tensor, scale, dtype):
    """Whole cache blocks ``blocks`` (any shape ``S``) as ``[*S * bs, Hkv, D]`` keys/values in
    ``dtype``, zero at the flat key indexes ``masked`` (stale slots: finite after this)."""
    n, bs, hkv, d = cache.shape
    rows = cache.view(n, bs * hkv * d).index_select(0, blocks.reshape(-1))
    rows = dequantize_kv(rows.view(-1, hkv, d), scale, dtype)
    if masked.numel():
        rows.index_fill_(0, masked, 0)
    return rows.view(*blocks.shape[:-1], blocks.shape[-1] * bs, hkv, d)


def paged_attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache,
                        plan: AttentionPlan, scale: float,
                        rows: Sequence[int] | None = None) -> torch.Tensor:
    """Attention of the flattened step (this step's K/V already stored in ``cache``).

    Args:
        query: ``[T, H, D]`` (any strides).
        key, value: this step's ``[T, Hkv, D]`` (read by fresh prefills only).
        cache: a ``LayerKVCache``.
        rows: the query rows whose output is used, ascending (None: all). A prefill through
            the C++ kernel then runs from its first such row only (none: skipped), its earlier
            rows left unwritten: the last layer, whose output only the sampled rows need.
    Returns:
        ``[T, H, D]`` in ``query.dtype``.
    """
    t, h, d = query.shape
    hkv = key.shape[1]
    out = torch.empty(t, h, d, dtype=query.dtype, device=query.device)
    if plan.decode_rows is not None:
        r = plan.decode_rows
        q = query.index_select(0, r.rows)                                # [B, H, D] contiguous
        out.index_copy_(0, r.rows, cpu_decode.paged_decode(q, cache.key, cache.value, r.tables,
                                                           r.starts, r.lens, scale))
    for g in plan.decode:
        q = query.index_select(0, g.rows).view(-1, hkv, h // hkv, d)     # [B, Hkv, G, D]
        k = _gather(cache.key, g.blocks, g.masked, cache.k_scale, query.dtype).transpose(1, 2)
        v = _gather(cache.value, g.blocks, g.masked, cache.v_scale, query.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask.to(query.dtype), scale=scale)
        out.index_copy_(0, g.rows, o.reshape(-1, h, d))
    # The C++ causal kernel where it applies; else SDPA with 4-D inputs (its CPU flash kernel,
    # GQA included; 3-D ones take the slow math path).
    for p in plan.prefill:
        if p.past is not None and cpu_prefill.usable(query, key, out):
            first = p.qs if rows is None else _first_row(rows, p.qs, p.qe)
            if first is not None:
                _prefill_kernel(query, key, value, cache, p, out, scale, first)
            continue
        q = query[p.qs:p.qe].transpose(0, 1)[None]                         # [1, H, Q, D]
        if p.blocks is None:
            k, v = key[p.qs:p.qe], value[p.qs:p.qe]
            o = F.scaled_dot_product_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                               is_causal=True, scale=scale, enable_gqa=h != hkv)
        else:
            k = _gather(cache.key, p.blocks, p.masked, cache.k_scale, query.dtype).transpose(0, 1)
            v = _gather(cache.value, p.blocks, p.masked, cache.v_scale, query.dtype).transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=p.mask.to(query.dtype),
                                               scale=scale, enable_gqa=h != hkv)
        out[p.qs:p.qe] = o[0].transpose(0, 1)
    return out


def _first_row(rows: Sequence[int], start: int, end: int) -> int | None:
    """The first of the ascending ``rows`` in ``[start, end)``, None if none is."""
    i = bisect.bisect_left(rows, start)
    return rows[i] if i < len(rows) and rows[i] < end else None


def _prefill_kernel(query, key, value, cache, p: PrefillSeq, out, scale, first: int) -> None:
    """``p``'s query rows ``[first, qe)`` through :func:`cpu_prefill.causal_attention`: its
    own K/V rows when fresh, else its blocks gathered once (the keys it reads,
    ``[0, past + Q)``, are all written). Row ``first`` sees ``past + first - qs`` keys before
    its own, as it does in the whole prefill."""
    if p.blocks is None:
        k, v = key[p.qs:p.qe], value[p.qs:p.qe]
    else:
        none = p.masked[:0]
        k = _gather(cache.key, p.blocks, none, cache.k_scale, query.dtype)
        v = _gather(cache.value, p.blocks, none, cache.v_scale, query.dtype)
    cpu_prefill.causal_attention(query[first:p.qe], k, v, out[first:p.qe], p.past + first - p.qs,
                                 scale)


def store_kv_cpu(key: torch.Tensor, value: torch.Tensor, cache, slot_mapping: torch.Tensor) -> None:
    """Write this step's ``key``/``value`` ``[T, Hkv, D]`` (any strides) at ``slot_mapping``
    ``[T]`` (int64, every slot valid: no padding): a float32 cache through
    :func:`cpu_ops.store_rows` (one copy per row) where the rows' heads and dims are
    contiguous, else ``index_copy_`` (quantized caches converted first; float8 rows copied as
    their bytes, since ``index_copy_`` has no float8 CPU kernel)."""
    n, bs, hkv, d = cache.key.shape
    if (cache.k_scale is None and cache.v_scale is None and key.dtype == value.dtype == torch.float32
            and cache.key.dtype == cache.value.dtype == torch.float32
            and all(t.stride(2) == 1 and t.stride(1) == d for t in (key, value))
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and cpu_ops.available()):
        cpu_ops.store_rows(cache.key.view(n * bs, hkv, d), slot_mapping, key)
        cpu_ops.store_rows(cache.value.view(n * bs, hkv, d), slot_mapping, value)
        return
    for rows, layer, scale in ((key, cache.key, cache.k_scale), (value, cache.value, cache.v_scale)):
        float8_as_bytes(layer.view(n * bs, hkv, d)).index_copy_(
            0, slot_mapping, float8_as_bytes(quantize_kv(rows, scale, layer.dtype)))
