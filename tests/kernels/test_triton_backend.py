"""``TritonBackend`` behind the backend interface, and its split-K heuristic."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvharbor.kernels import LayerKVCache, ReferenceBackend, get_attention_backend
from kvharbor.kernels import paged_attention as pa_module
from kvharbor.kernels.triton_backend import (MAX_SPLITS, MIN_KEYS_PER_SPLIT, TritonBackend,
                                             choose_num_splits)

from .batch import TOLERANCE, make_batch


def test_kernels_run_in_the_interpreter_without_cuda():
    """tests/conftest.py sets TRITON_INTERPRET=1 before triton is first imported."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: kernels are compiled")
    assert pa_module.INTERPRETED


def test_get_attention_backend_returns_triton():
    assert isinstance(get_attention_backend("triton", "cpu"), TritonBackend)
    assert get_attention_backend("triton", "cpu").name == "triton"


def _fresh_copy(cache: LayerKVCache) -> LayerKVCache:
    return dataclasses.replace(cache, key=cache.key.clone(), value=cache.value.clone())


@pytest.mark.parametrize("cache_dtype", [None, torch.int8], ids=["fp16", "int8"])
def test_store_then_attend_matches_reference_backend(cache_dtype):
    """One engine step: store this step's K/V, then attend; both backends agree."""
    q_lens, kv_lens = [1, 6, 1], [90, 30, 17]
    batch = make_batch(q_lens, kv_lens, heads=4, kv_heads=2, head_dim=32, block_size=16,
                       dtype=torch.float16, cache_dtype=cache_dtype, seed=21)
    # The step's own tokens are the last q_len of each sequence: re-store them through each
    # backend into a copy where they were wiped.
    ends = torch.tensor(kv_lens).cumsum(0)
    new = torch.cat([torch.arange(e - q, e) for e, q in zip(ends.tolist(), q_lens)])
    results = []
    for backend in (TritonBackend(), ReferenceBackend()):
        cache = _fresh_copy(batch.cache)
        for part in (cache.key, cache.value):
            part.view(-1, 2, 32)[batch.slot_mapping[new]] = 0
        backend.store_kv(batch.key[new], batch.value[new], cache, batch.slot_mapping[new])
        results.append(backend.paged_attention(batch.query, cache, batch.block_tables,
                                               batch.seq_lens, batch.query_start_loc,
                                               32 ** -0.5, None, max(kv_lens)))
    tol = TOLERANCE[torch.float16]
    torch.testing.assert_close(results[0].float(), results[1].float(), atol=tol, rtol=tol)


def launches(monkeypatch, kwarg: str) -> list:
    """The ``kwarg`` of every kernel launch the backend makes from now on (the kernel runs)."""
    used, real = [], pa_module.paged_attention

    def spy(*args, **kwargs):
        used.append(kwargs[kwarg])
        return real(*args, **kwargs)

    monkeypatch.setattr("kvharbor.kernels.triton_backend.paged_attention", spy)
    return used


def backend_matches_reference(batch) -> None:
    args = (batch.query, batch.cache, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, 32 ** -0.5)
    out = TritonBackend.paged_attention(*args)
    ref = ReferenceBackend.paged_attention(*args)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_long_context_decode_uses_split_k_and_matches_reference(monkeypatch):
    """A 2-sequence decode over 1300 keys goes through split-K and the reduce kernel."""
    used = launches(monkeypatch, "num_splits")
    backend_matches_reference(make_batch([1, 1], [1300, 700], heads=4, kv_heads=1, head_dim=32,
                                         block_size=16, dtype=torch.float32, seed=23))
    assert used and used[0] > 1


def test_the_backend_takes_the_decode_path_for_decode_only_batches(monkeypatch):
    """One token per sequence (every engine step gives each sequence >= 1 token): the
    kernel's decode path; a batch with a prefill: the searching path. Same results."""
    used = launches(monkeypatch, "decode_only")
    for q_lens in ([1, 1, 1], [1, 4, 1]):
        backend_matches_reference(make_batch(q_lens, [90, 40, 17], heads=4, kv_heads=2, head_dim=32,
                                             block_size=16, dtype=torch.float32, seed=37))
    assert used == [True, False]


def test_split_k_heuristic():
    """Split only decode-only, under-occupied, long-context batches; powers of 2, bounded."""
    assert choose_num_splits(5, 2, 8, 16384) == 1                     # has a prefill
    assert choose_num_splits(256, 256, 8, 16384) == 1                 # GPU already full
    assert choose_num_splits(1, 1, 8, 512) == 1                       # too short to split
    for batch in (1, 2, 4, 8):
        for ctx in (1024, 4096, 16384, 131072):
            s = choose_num_splits(batch, batch, 8, ctx, num_sms=132)
            assert s & (s - 1) == 0 and 1 <= s <= MAX_SPLITS
            assert s == 1 or ctx // s >= MIN_KEYS_PER_SPLIT
    assert choose_num_splits(1, 1, 8, 16384, num_sms=132) >= 16
    # the H200 sweep's points: batch 16 x 8 KV heads splits 4 ways, batch 64 not at all
    assert choose_num_splits(16, 16, 8, 4096, num_sms=132) == 4
    assert choose_num_splits(64, 64, 8, 16384, num_sms=132) == 1
