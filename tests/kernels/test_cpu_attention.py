"""The planned CPU attention (the engine's CPU hot path) against the torch reference.

Caches come from ``make_batch``: blocks no sequence owns and the block-table padding are
poisoned (NaN), so a gather past a sequence's end shows up as NaN, not as a lucky pass.
"""

from __future__ import annotations

import pytest
import torch

from kvharbor.kernels import CpuBackend, LayerKVCache, cpu_decode, cpu_prefill, get_attention_backend
from kvharbor.kernels.cpu_attention import (DECODE_GROUP, SHORT_QUERY, paged_attention_cpu, plan_attention,
                                            store_kv_cpu)
from kvharbor.kernels.reference import paged_attention_ref, store_kv_ref

from .batch import TOLERANCE, make_batch


def run_planned(batch, window=None, use_new_kv=True, pad_block=None, decode_kernel=False, only=None):
    """The engine's call: plan once, then attend; this step's K/V are the last q_len rows."""
    q, c = batch.query, batch.cache
    qsl, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    plan = plan_attention(batch.block_tables, lens, qsl, c.key.shape[1], window, use_new_kv, pad_block,
                          decode_kernel)
    kernel_rows = [q for q, n in zip(batch.query_start_loc.diff().tolist(), lens)
                   if q == 1 or q <= SHORT_QUERY and q < n]
    assert (plan.decode_rows is not None) == (decode_kernel and bool(kernel_rows))
    if plan.decode_rows is not None:
        assert plan.decode_rows.rows.numel() == sum(kernel_rows)
    # This step's K/V rows [T, Hkv, D]: each sequence's last q_len tokens.
    starts = [sum(lens[:b]) for b in range(len(lens))]
    rows = torch.cat([torch.arange(s + n - (qsl[b + 1] - qsl[b]), s + n)
                      for b, (s, n) in enumerate(zip(starts, lens))]).to(batch.key.device)
    return paged_attention_cpu(q, batch.key[rows], batch.value[rows], c, plan, q.shape[-1] ** -0.5,
                               only)


def check(batch, window=None, use_new_kv=True, pad_block=None, decode_kernel=False):
    q, c = batch.query, batch.cache
    out = run_planned(batch, window, use_new_kv, pad_block, decode_kernel)
    ref = paged_attention_ref(q, *batch.args, q.shape[-1] ** -0.5, window, c.k_scale, c.v_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "read poisoned (unowned) cache memory"
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads, kv_heads, window, block_size", [
    (8, 2, None, 16), (4, 4, None, 1), (9, 3, 64, 16), (4, 1, 100, 32)],
    ids=["gqa4", "mha-bs1", "gqa3-window", "gqa4-window-bs32"])
def test_mixed_batch_matches_reference(heads, kv_heads, window, block_size):
    """Decodes of many lengths (more than one decode group), a prefill over a cached prefix,
    a fresh prefill and a chunk continuing one, in one step."""
    n_dec = DECODE_GROUP + 5
    q_lens = [1] * n_dec + [7, 40, 13]
    kv_lens = [3 + 37 * i % 700 for i in range(n_dec)] + [300, 40, 213]
    batch = make_batch(q_lens, kv_lens, heads=heads, kv_heads=kv_heads, head_dim=32,
                       block_size=block_size, dtype=torch.float32, seed=heads)
    check(batch, window)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_cache_reads_dequantized_keys_everywhere(cache_dtype):
    """With a quantized cache even a fresh prefill reads the cache (use_new_kv=False), so it
    sees the same keys as the reference."""
    batch = make_batch([1, 9, 1], [90, 9, 17], heads=4, kv_heads=2, head_dim=32, block_size=16,
                       dtype=torch.float32, cache_dtype=cache_dtype, seed=3)
    check(batch, use_new_kv=False)


@pytest.mark.skipif(not cpu_prefill.available(), reason="C++ prefill kernel not built")
def test_prefills_run_only_from_their_first_read_row(monkeypatch):
    """The last layer reads only the sampled rows: a prefill through the C++ kernel runs from
    its first read row (a fresh one and one over a cached prefix), one with no read row not
    at all, and the read rows are what the whole step gives them (to float rounding: the
    kernel's sums may depend on how many rows it runs, 6.6e-7 apart on an AVX2-only EPYC)."""
    q_lens, kv_lens = [1, 70, 40, 13, 1], [50, 70, 300, 13, 90]
    batch = make_batch(q_lens, kv_lens, heads=9, kv_heads=3, head_dim=32, block_size=16,
                       dtype=torch.float32, seed=8)
    whole = run_planned(batch)
    queries = []
    kernel = cpu_prefill.causal_attention
    monkeypatch.setattr(cpu_prefill, "causal_attention",
                        lambda q, *a: queries.append(q.shape[0]) or kernel(q, *a))
    # Rows 0 and 124 are the decodes; 70 (the fresh prefill's last row, 1 + 69) and 100 and
    # 110 (inside the cached prefill) are read; the 13-token prefill (rows 111-123) is not.
    read = [0, 70, 100, 110, 124]
    part = run_planned(batch, only=read)
    assert queries == [1, 11]                   # from row 70 of [1, 71); from 100 of [71, 111)
    torch.testing.assert_close(part[read], whole[read], rtol=1e-5, atol=1e-5)
    queries.clear()
    assert run_planned(batch, only=[]).shape == whole.shape and queries == []   # nothing read


def test_fresh_prefill_uses_this_steps_kv_without_reading_the_cache():
    """A prefill with no earlier tokens attends over the K/V it was given: poisoning its cache
    blocks afterwards changes nothing (and must not, or the shortcut read the cache)."""
    batch = make_batch([30], [30], heads=4, kv_heads=2, head_dim=16, block_size=16,
                       dtype=torch.float32, seed=5)
    before = run_planned(batch)
    batch.cache.key.fill_(float("nan"))
    torch.testing.assert_close(run_planned(batch), before, atol=0, rtol=0)


def test_padding_with_a_zero_block_matches_reference():
    """The engine pads short sequences of a decode group with its null block (zeros)."""
    q_lens, kv_lens = [1, 1, 1, 1], [5, 200, 37, 64]
    batch = make_batch(q_lens, kv_lens, heads=4, kv_heads=2, head_dim=32, block_size=16,
                       dtype=torch.float32, seed=4, num_blocks=40)
    used = {int(batch.block_tables[b, i]) for b, n in enumerate(kv_lens) for i in range(-(-n // 16))}
    zero_block = min(set(range(40)) - used)
    batch.cache.key[zero_block] = 0
    batch.cache.value[zero_block] = 0
    check(batch, pad_block=zero_block)


def test_store_kv_cpu_writes_the_same_bytes_as_the_reference():
    batch = make_batch([3, 1], [20, 9], heads=4, kv_heads=2, head_dim=16, block_size=8,
                       dtype=torch.float32, seed=9)
    ours, ref = (type(batch.cache)(batch.cache.key.clone(), batch.cache.value.clone()) for _ in "ab")
    store_kv_cpu(batch.key, batch.value, ours, batch.slot_mapping)
    store_kv_ref(batch.key, batch.value, ref.key, ref.value, batch.slot_mapping)
    assert torch.equal(ours.key.view(torch.int32), ref.key.view(torch.int32))
    assert torch.equal(ours.value.view(torch.int32), ref.value.view(torch.int32))


@pytest.mark.parametrize("cache_dtype", ["float32", "int8", "fp8_e4m3"])
def test_store_kv_cpu_from_qkv_columns_matches_the_reference(cache_dtype, monkeypatch):
    """k and v as the engine passes them (column slices of one qkv product): a float32 cache
    is written by the row-copy op, a quantized one by the reference's conversion; either way
    the reference's bytes."""
    from kvharbor.kernels import KV_CACHE_DTYPES, cpu_ops  # noqa: PLC0415

    if not cpu_ops.available():
        pytest.skip("no C++ compiler to build the ops")
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(50, 8 * 16 + 2 * 2 * 16, generator=g)
    k, v = (t.view(50, 2, 16) for t in qkv[:, 128:].split(32, dim=-1))
    slots = torch.randperm(24 * 8, generator=g)[:50]
    dtype = KV_CACHE_DTYPES.get(cache_dtype) or torch.float32
    scale = None if cache_dtype == "float32" else torch.tensor([0.05, 0.04])
    cache = LayerKVCache(torch.zeros(24, 8, 2, 16, dtype=dtype), torch.zeros(24, 8, 2, 16, dtype=dtype),
                         scale, scale)
    ref_k, ref_v = cache.key.clone(), cache.value.clone()
    calls = []
    store_rows = cpu_ops.store_rows
    monkeypatch.setattr(cpu_ops, "store_rows", lambda *a: calls.append(1) or store_rows(*a))
    store_kv_cpu(k, v, cache, slots)
    store_kv_ref(k, v, ref_k, ref_v, slots, scale, scale)
    assert len(calls) == (2 if cache_dtype == "float32" else 0)
    assert torch.equal(cache.key.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(cache.value.view(torch.uint8), ref_v.view(torch.uint8))


def test_auto_backend_on_cpu_is_the_planned_one():
    backend = get_attention_backend("auto", "cpu")
    assert isinstance(backend, CpuBackend) and backend.plans
    assert not getattr(get_attention_backend("reference", "cpu"), "plans", False)


needs_kernel = pytest.mark.skipif(torch.cuda.is_available() or not cpu_decode.available(),
                                  reason="CPU-only kernel (batches are on the GPU), or not built")


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, window, block_size, head_dim", [
    (8, 2, None, 16, 32), (9, 3, 64, 16, 32), (4, 4, None, 1, 32), (6, 2, 100, 32, 32),
    (9, 3, None, 12, 64), (2, 1, 100, 16, 128), (8, 4, None, 16, 16), (4, 2, 64, 16, 24)],
    ids=["gqa4", "gqa3-window", "mha-bs1", "gqa3-window-bs32", "d64-bs12", "d128-window",
         "d16", "d24-plain-loop"])
def test_cpp_decode_kernel_matches_reference(heads, kv_heads, window, block_size, head_dim):
    """Decodes through the C++ kernel (reading the poisoned cache in place) and prefills
    through SDPA, in one step. Head dims 16-128 take the vector path (8 keys at a time, so
    blocks of 1 and 12 leave partial groups), 24 the plain loop."""
    q_lens = [1] * 9 + [7, 30]
    kv_lens = [1, 5, 16, 17, 300, 640, 33, 129, 64, 300, 30]
    batch = make_batch(q_lens, kv_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=torch.float32, seed=heads + block_size)
    check(batch, window, decode_kernel=True)


@needs_kernel
@pytest.mark.parametrize("window, block_size", [(None, 16), (64, 16), (None, 1), (40, 32)])
def test_cpp_decode_kernel_runs_short_continuations_exactly(window, block_size):
    """Queries of 2-17 tokens after cached keys (speculative decoding's drafts being verified)
    go to the decode kernel, one row per query token over the keys up to it (causal within
    the query); longer ones and fresh prompts stay prefills. All match the reference."""
    q_lens = [5, SHORT_QUERY, 2, 3, SHORT_QUERY + 1, 1, 9]
    kv_lens = [40, 300, 17, 3, 500, 70, 9]     # 3 and 9: fresh prompts (no cached keys)
    batch = make_batch(q_lens, kv_lens, heads=8, kv_heads=2, head_dim=32, block_size=block_size,
                       dtype=torch.float32, seed=block_size)
    check(batch, window, decode_kernel=True)


@needs_kernel
def test_cpp_decode_kernel_rows_read_their_own_requests_blocks():
    """As many kernel rows as requests, yet not one per request (a 2-token continuation next
    to a fresh prompt): both rows read the continuing request's blocks, not one row each."""
    batch = make_batch([2, 40], [90, 40], heads=8, kv_heads=2, head_dim=32, block_size=16,
                       dtype=torch.float32, seed=5)
    check(batch, None, decode_kernel=True)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("q_lens, kv_lens", [([1], [700]), ([1, 1, 5], [3, 290, 40]),
                                             ([1, 1, 1, 1, 1], [900, 17, 1, 64, 333])],
                         ids=["one-seq", "two-seqs", "five-seqs"])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 2), (4, 4), (4, 1)])
def test_cpp_decode_kernel_splits_few_or_uneven_sequences_exactly(threads, q_lens, kv_lens, heads,
                                                                   kv_heads):
    """With fewer sequences than twice the threads the kernel splits by KV head, else by runs
    of sequences holding equal shares of the keys: every head of every row is still computed
    exactly once (a head left out reads as the poison, one done twice or by the wrong unit
    differs from the reference)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = make_batch(q_lens, kv_lens, heads=heads, kv_heads=kv_heads, head_dim=64,
                           block_size=16, dtype=torch.float32, seed=len(q_lens) + heads)
        check(batch, None, decode_kernel=True)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_cpp_decode_kernel_is_built_to_use_torchs_threads():
    """ATen's parallel_for is inlined into the kernel: built without OpenMP it silently runs
    every batch on one thread (2 threads were measured no faster than 1)."""
    assert cpu_decode.threaded()


@needs_kernel
def test_cpp_decode_kernel_rejects_wrong_dtypes():
    batch = make_batch([1], [20], heads=4, kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    c = batch.cache
    args = (batch.block_tables.long(), torch.zeros(1, dtype=torch.long), batch.seq_lens.long(), 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_decode.paged_decode(batch.query.double(), c.key, c.value, *args)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_decode.paged_decode(batch.query, c.key, c.value, batch.block_tables, *args[1:])
