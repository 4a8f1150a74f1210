"""Torch reference for every kernel: the oracle the Triton kernels are tested against,
and the attention path the engine runs on CPU.

Cache layout, per layer (one tensor for K, one for V)::

    cache[block_id, offset_in_block, kv_head, head_dim]      # [N, bs, Hkv, D]

A token at absolute position ``p`` of a sequence lives in slot
``block_table[p // bs] * bs + p % bs``.

The flattened batch: sequence ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]``;
its K/V length *after* this step's tokens were stored is ``seq_lens[b]``, so its queries sit at
positions ``seq_lens[b] - q_len .. seq_lens[b] - 1``. Query ``p`` attends to key ``k`` iff
``k <= p`` and, with a sliding window ``W``, ``k > p - W`` (transformers' convention).

Quantized caches (int8 / float8_e4m3fn) store ``round(x / scale)`` with one float32 scale per
KV head (``k_scale``/``v_scale``, shape ``[Hkv]``), calibrated once when the cache is made.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, cache_dtype: torch.dtype) -> torch.Tensor:
    """Convert new K or V rows ``[T, Hkv, D]`` to the cache dtype (scale ``[Hkv]`` or None)."""
    if scale is None:
        return x.to(cache_dtype)
    y = x.float() / scale.view(1, -1, 1)
    if cache_dtype == torch.int8:
        return y.round_().clamp_(-127, 127).to(torch.int8)
    return y.clamp(-448.0, 448.0).to(cache_dtype)


def float8_as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (``uint8``, same shape), any other as it is: index copies
    of float8 lack kernels on some devices (``index_copy_`` on the CPU)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv` for rows ``[..., Hkv, D]``, returned in ``dtype``."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale.view(*([1] * (x.dim() - 2)), -1, 1)).to(dtype)


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into their slots (``slot_mapping`` ``[T]``, int64).

    A negative slot means "do not store" (padding).
    """
    n, bs, hkv, d = key_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.view(n * bs, hkv, d)[slots] = quantize_kv(key[keep], k_scale, key_cache.dtype)
    value_cache.view(n * bs, hkv, d)[slots] = quantize_kv(value[keep], v_scale, value_cache.dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int, scale, dtype) -> torch.Tensor:
    """K or V of one sequence: ``[Hkv, length, D]`` in ``dtype``."""
    rows = cache[blocks].flatten(0, 1)[:length]                       # [L, Hkv, D]
    return dequantize_kv(rows, scale, dtype).transpose(0, 1)


def _mask(q_pos: torch.Tensor, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean ``[Q, K]``: True where query at ``q_pos`` may attend key position k."""
    k_pos = torch.arange(kv_len, device=q_pos.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return allowed


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        sliding_window: int | None = None,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the flattened batch over the paged cache.

    Args:
        query: ``[T, H, D]`` for all scheduled tokens, sequences back to back.
        key_cache, value_cache: ``[N, bs, Hkv, D]`` (this step's K/V already stored).
        block_tables: ``[B, max_blocks]`` int32.
        seq_lens: ``[B]`` K/V length of each sequence including this step's tokens.
        query_start_loc: ``[B + 1]`` int32 offsets into ``query``.
        scale: softmax scale.
        sliding_window: window size or None.
        k_scale, v_scale: ``[Hkv]`` float32 for quantized caches, else None.
    Returns:
        ``[T, H, D]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    bs = key_cache.shape[1]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    h, hkv = query.shape[1], key_cache.shape[2]
    decode = [b for b in range(len(lens)) if qsl[b + 1] - qsl[b] == 1]
    if len(decode) > 1:
        _decode_batch(query, key_cache, value_cache, block_tables, lens, qsl, decode, scale,
                      sliding_window, k_scale, v_scale, out)
        decode_set = set(decode)
    else:
        decode_set = set()
    for b, kv_len in enumerate(lens):
        if b in decode_set:
            continue
        qs, qe = qsl[b], qsl[b + 1]
        if qe == qs:
            continue
        blocks = block_tables[b, :(kv_len + bs - 1) // bs].long()
        k = _gather(key_cache, blocks, kv_len, k_scale, query.dtype)
        v = _gather(value_cache, blocks, kv_len, v_scale, query.dtype)
        q_pos = torch.arange(kv_len - (qe - qs), kv_len, device=query.device)
        mask = _mask(q_pos, kv_len, sliding_window)
        o = F.scaled_dot_product_attention(query[qs:qe].transpose(0, 1), k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=h != hkv)
        out[qs:qe] = o.transpose(0, 1)
    return out


def _decode_batch(query, key_cache, value_cache, block_tables, lens, qsl, rows, scale,
                  sliding_window, k_scale, v_scale, out) -> None:
    """All single-token sequences in one padded SDPA call (same math as the loop)."""
    bs = key_cache.shape[1]
    idx = torch.tensor(rows, device=query.device)
    kv_lens = torch.tensor([lens[b] for b in rows], device=query.device)
    max_len = int(kv_lens.max())
    nblk = (max_len + bs - 1) // bs
    blocks = block_tables[idx, :nblk].long()                         # [B, nblk]
    k = dequantize_kv(key_cache[blocks].flatten(1, 2)[:, :max_len], k_scale, query.dtype)
    v = dequantize_kv(value_cache[blocks].flatten(1, 2)[:, :max_len], v_scale, query.dtype)
    # Slots past a sequence's own length are padding (other blocks, unwritten memory): zero
    # them, or a NaN/inf there leaks through the masked softmax (0 * NaN = NaN). k and v are
    # fresh gathers, so this writes only the padding, in place.
    past_end = (torch.arange(max_len, device=query.device)[None, :] >= kv_lens[:, None])
    k[past_end] = 0                                                  # [B, L, Hkv, D]
    v[past_end] = 0
    q_rows = torch.tensor([qsl[b] for b in rows], device=query.device)
    hkv = key_cache.shape[2]
    # GQA without repeating K/V: the G query heads of one KV head are G query rows over it.
    q = query[q_rows].view(len(rows), hkv, -1, query.shape[-1])     # [B, Hkv, G, D]
    k_pos = torch.arange(max_len, device=query.device)[None, :]
    q_pos = (kv_lens - 1)[:, None]
    mask = k_pos <= q_pos
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None, None, :], scale=scale)
    out[q_rows] = o.reshape(len(rows), query.shape[1], query.shape[-1])
