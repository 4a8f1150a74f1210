"""Triton paged attention (and its split-K variant) against the torch reference.

Runs under ``TRITON_INTERPRET=1`` on CPU; shapes stay small except the KV lengths (up to
1328) and the block ids (past 2**20, so element offsets pass 2**31).
"""

from __future__ import annotations

import pytest
import torch

from kvharbor.kernels.paged_attention import paged_attention
from kvharbor.kernels.reference import paged_attention_ref

from .batch import TOLERANCE, make_batch

MIXED_Q = [1, 5, 129, 1]          # decode, prefill over a prefix, long prefill, decode
MIXED_KV = [1328, 5, 463, 40]     # the 5-token prefill has no cached prefix


def check(batch, sliding_window=None, num_splits=1, tol=None, decode_only=False):
    """Run both implementations on ``batch`` and compare with an explicit tolerance."""
    q, c = batch.query, batch.cache
    scale = q.shape[-1] ** -0.5
    out = paged_attention(q, *batch.args, scale, sliding_window, c.k_scale, c.v_scale,
                          num_splits=num_splits, decode_only=decode_only)
    ref = paged_attention_ref(q, *batch.args, scale, sliding_window, c.k_scale, c.v_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "kernel read poisoned (unowned) cache memory"
    tol = tol or TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize(
    "group, dtype, window, block_size, head_dim",
    [
        (1, torch.float32, None, 16, 32),
        (4, torch.float16, 256, 32, 64),
        (8, torch.bfloat16, None, 16, 32),
        (4, torch.float32, 100, 1, 32),
        (1, torch.bfloat16, 64, 16, 128),
    ],
    ids=["mha-fp32", "gqa4-fp16-window", "gqa8-bf16", "gqa4-fp32-bs1-window",
         "mha-bf16-d128-window"],
)
def test_mixed_prefill_decode_batch(group, dtype, window, block_size, head_dim):
    """Decodes, a prefill over a cached prefix and a fresh prefill in one flattened batch."""
    batch = make_batch(MIXED_Q, MIXED_KV, heads=group, kv_heads=1, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, seed=group)
    check(batch, sliding_window=window)


def test_two_kv_heads_map_to_their_own_query_groups():
    """With Hkv=2, query heads 0-3 read KV head 0 and 4-7 read KV head 1."""
    batch = make_batch([3, 1], [70, 33], heads=8, kv_heads=2, head_dim=32, block_size=16,
                       dtype=torch.float32, seed=3)
    check(batch)


@pytest.mark.parametrize(
    "cache_dtype, dtype, window",
    [(torch.int8, torch.float16, None), (torch.int8, torch.float32, 50),
     (torch.float8_e4m3fn, torch.bfloat16, None), (torch.float8_e4m3fn, torch.float32, 50)],
    ids=["int8-fp16", "int8-fp32-window", "fp8-bf16", "fp8-fp32-window"],
)
def test_quantized_cache_is_dequantized_in_kernel(cache_dtype, dtype, window):
    """int8 / fp8 caches with per-head scales give the reference's dequantized result."""
    batch = make_batch([1, 7, 1], [300, 40, 90], heads=4, kv_heads=2, head_dim=32,
                       block_size=16, dtype=dtype, cache_dtype=cache_dtype, seed=7)
    check(batch, sliding_window=window)


@pytest.mark.parametrize("window", [None, 200], ids=["full", "window"])
def test_split_k_matches_single_pass(window):
    """Flash-decoding splits (incl. splits that get no keys) equal the unsplit kernel."""
    batch = make_batch([1, 1, 1], [1328, 17, 600], heads=8, kv_heads=2, head_dim=32,
                       block_size=16, dtype=torch.float32, seed=11)
    single = check(batch, sliding_window=window)
    split = check(batch, sliding_window=window, num_splits=5)
    torch.testing.assert_close(split, single, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype, head_dim, num_splits", [(torch.float16, 64, 1), (torch.bfloat16, 128, 4)],
                         ids=["fp16-d64", "bf16-d128-split4"])
def test_decode_with_128_key_tiles_matches_reference(dtype, head_dim, num_splits):
    """The wide decode tile (128 keys per step, 16-bit caches when split or heads <= 64)."""
    from kvharbor.kernels.paged_attention import default_tile

    assert default_tile(3, 3, 4, head_dim, 2, num_splits)[1] == 128
    assert default_tile(3, 3, 4, head_dim, 4, num_splits)[1] == 64         # fp32 caches stay at 64
    batch = make_batch([1, 1, 1], [700, 129, 300], heads=8, kv_heads=2, head_dim=head_dim,
                       block_size=16, dtype=dtype, seed=23)
    check(batch, num_splits=num_splits)


@pytest.mark.parametrize(
    "heads, kv_heads, dtype, cache_dtype, window, num_splits",
    [(14, 2, torch.bfloat16, None, None, 1), (8, 2, torch.float16, None, 200, 4),
     (4, 2, torch.float32, torch.int8, None, 1), (8, 8, torch.float32, None, 64, 2)],
    ids=["gqa7-bf16", "gqa4-fp16-window-split4", "gqa2-fp32-int8", "mha-fp32-window-split2"],
)
def test_decode_only_path_equals_the_searching_path(heads, kv_heads, dtype, cache_dtype, window,
                                                    num_splits):
    """``decode_only``: each program takes sequence ``tile`` without the search; the output
    is the reference's and bit for bit the searching path's (qwen2's GQA group of 7 too)."""
    batch = make_batch([1] * 5, [700, 1, 129, 33, 300], heads=heads, kv_heads=kv_heads,
                       head_dim=32, block_size=16, dtype=dtype, cache_dtype=cache_dtype or dtype,
                       seed=29)
    searched = check(batch, sliding_window=window, num_splits=num_splits)
    direct = check(batch, sliding_window=window, num_splits=num_splits, decode_only=True)
    assert torch.equal(direct, searched)


def test_decode_only_refuses_a_batch_with_other_than_one_token_per_sequence():
    """T == B is not enough: a 2-token and an empty sequence also make 2 tokens for 2."""
    batch = make_batch([2, 0], [10, 20], heads=2, kv_heads=1, head_dim=16, block_size=16,
                       dtype=torch.float32, seed=31)
    check(batch)                                   # the searching path handles it
    with pytest.raises(AssertionError, match="one token per sequence"):
        check(make_batch([2, 1], [10, 20], heads=2, kv_heads=1, head_dim=16, block_size=16,
                         dtype=torch.float32, seed=31), decode_only=True)


def test_split_k_on_a_mixed_batch():
    """Split-K is correct with prefills in the batch too (the backend splits only decodes)."""
    batch = make_batch([1, 5, 20], [500, 5, 120], heads=4, kv_heads=1, head_dim=32,
                       block_size=32, dtype=torch.float16, seed=5)
    check(batch, num_splits=3)


def test_block_ids_past_int32_element_offsets():
    """Blocks >= 2**20 of a [2**20 + 64, 32, 1, 64] int8 cache sit past element 2**31."""
    n = 2**20 + 64
    batch = make_batch([1, 4], [100, 40], heads=4, kv_heads=1, head_dim=64, block_size=32,
                       dtype=torch.float32, cache_dtype=torch.int8, num_blocks=n,
                       min_block_id=2**20, seed=13)
    assert int(batch.block_tables.min()) * 32 * 64 >= 2**31
    check(batch)


def test_zero_length_query_rows_are_skipped():
    """A sequence with no tokens this step (q_len 0) does not disturb its neighbours."""
    batch = make_batch([2, 0, 1], [10, 20, 30], heads=2, kv_heads=1, head_dim=16,
                       block_size=16, dtype=torch.float32, seed=17)
    check(batch)


@pytest.mark.parametrize("mutate, message", [
    (lambda b: setattr(b, "block_tables", b.block_tables.long()), "block_tables must be int32"),
    (lambda b: setattr(b, "seq_lens", b.seq_lens.long()), "seq_lens must be int32"),
    (lambda b: setattr(b, "query", b.query[:, :3]), "multiple of KV heads"),
    (lambda b: setattr(b, "query", b.query.double()), "query dtype"),
    (lambda b: setattr(b.cache, "k_scale", None), "needs k_scale"),
])
def test_launcher_rejects_bad_inputs(mutate, message):
    """Shape / dtype mistakes fail before launch with a message naming the argument."""
    batch = make_batch([1], [8], heads=4, kv_heads=2, head_dim=16, block_size=16,
                       dtype=torch.float32, cache_dtype=torch.int8)
    mutate(batch)
    with pytest.raises(AssertionError, match=message):
        paged_attention(batch.query, *batch.args, 0.25, None, batch.cache.k_scale,
                        batch.cache.v_scale)
