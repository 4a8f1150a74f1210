"""The Triton attention backend: :func:`store_kv` and :func:`paged_attention` kernels behind
the interface of :class:`kvharbor.kernels.ReferenceBackend`.

Split-K (flash decoding) is chosen by :func:`choose_num_splits`: only for decode-only batches
whose (sequence, KV head) programs would leave most SMs idle and whose context is long.
"""

from __future__ import annotations

import torch
import triton

from .paged_attention import paged_attention
from .store_kv import store_kv

MIN_KEYS_PER_SPLIT = 512
"""A split shorter than this costs more in the reduce than it gains in parallelism."""
MAX_SPLITS = 32
TARGET_WAVES = 4
"""Split-K aims at this many waves of (sequence, KV head, split) programs over the SMs, and
splits only batches under :data:`SPLIT_BELOW_WAVES` waves unsplit. Read off a sweep on an H200
before the kernel had its decode path (docs/benchmarks.md, "Decode attention on an H200"),
where at batch 16 x 8 KV heads 4-16 splits ran 1.2-1.8x faster than 2. With the decode path
(fourth GPU session) 2 splits are the fastest there (68.9 against 80.4 us at 4k), and the
rule's config is up to 28% slower than the best at other points (head dim 64, batch 48); two
replacement rules were tried on points they were not read off and lost
(scripts/split_candidates.py)."""
SPLIT_BELOW_WAVES = 3
DEFAULT_NUM_SMS = 132
"""H100 SXM; used when the device reports no SM count (CPU under the interpreter)."""


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def choose_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int = DEFAULT_NUM_SMS) -> int:
    """Number of key splits per (sequence, KV head) for this batch; 1 means no split-K.

    Split only a decode-only batch (``num_tokens == num_seqs``) with fewer programs than
    :data:`SPLIT_BELOW_WAVES` waves of SMs, towards :data:`TARGET_WAVES` waves, and never below
    :data:`MIN_KEYS_PER_SPLIT` keys per split. A power of 2.
    """
    programs = num_seqs * num_kv_heads
    if num_tokens != num_seqs or programs >= SPLIT_BELOW_WAVES * num_sms:
        return 1
    by_parallelism = triton.cdiv(TARGET_WAVES * num_sms, programs)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    splits = min(by_parallelism, by_length, MAX_SPLITS)
    if splits < 2:
        return 1
    return 1 << (splits.bit_length() - 1)


class TritonBackend:
    """Triton kernels (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``)."""

    name = "triton"
    strided = True          # q/k/v may be strided views (head_dim contiguous): no copies

    @staticmethod
    def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      device: torch.device) -> int:
        """The split-K count this backend launches for a decode-only batch (one token per
        sequence): what a CUDA graph of that step must be captured with."""
        return choose_num_splits(num_seqs, num_seqs, num_kv_heads, max_seq_len, _num_sms(device))

    @staticmethod
    def store_kv(key, value, cache, slot_mapping) -> None:
        """Write ``key``/``value`` ``[T, Hkv, D]`` into ``cache`` at ``slot_mapping`` (int64)."""
        store_kv(key, value, cache.key, cache.value, slot_mapping, cache.k_scale, cache.v_scale)

    @staticmethod
    def paged_attention(query, cache, block_tables, seq_lens, query_start_loc,
                        scale, sliding_window=None, max_seq_len=None):
        """Paged attention of the flattened batch; ``max_seq_len`` avoids a host sync.

        An engine step gives every sequence it holds at least one query token, so a batch
        with as many tokens as sequences is decode-only (one each): split-K and the kernel's
        decode path (no search for each program's sequence) apply to it."""
        num_tokens, num_seqs = query.shape[0], block_tables.shape[0]
        splits = 1
        decode = num_tokens == num_seqs and num_seqs > 0
        if decode:
            if max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            splits = TritonBackend.decode_splits(num_seqs, cache.key.shape[2], max_seq_len,
                                                 query.device)
        return paged_attention(query, cache.key, cache.value, block_tables, seq_lens,
                               query_start_loc, scale, sliding_window, cache.k_scale,
                               cache.v_scale, num_splits=splits, decode_only=decode)
