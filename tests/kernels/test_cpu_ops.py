"""The fused CPU ops of the model path against the transformers code they replace."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kvharbor.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler to build the ops")


def norm_module(hidden: int, seed: int) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return norm


@pytest.mark.parametrize("rows", [1, 7, 2048])
@pytest.mark.parametrize("hidden", [256, 576, 100])
def test_rms_norm_matches_transformers(rows, hidden):
    g = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=g) * 3
    norm = norm_module(hidden, rows)
    with torch.no_grad():
        torch.testing.assert_close(cpu_ops.rms_norm(x, norm.weight.detach(), 1e-5), norm(x),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [3, 1500])
def test_add_rms_norm_adds_in_place_bit_exactly_and_norms_the_sum(rows):
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g)
    before = residual.clone()
    norm = norm_module(576, 1)
    out = cpu_ops.add_rms_norm(x, residual, norm.weight.detach(), 1e-5)
    assert torch.equal(residual, before + x)
    with torch.no_grad():
        torch.testing.assert_close(out, norm(before + x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 33, 600])
def test_rotary_in_place_on_qkv_views_is_bit_exact(rows):
    """q and k are column slices of one packed [T, q + k + v] product: strided rows."""
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 9 * 64 + 2 * 3 * 64, generator=g)
    cos, sin = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
    q, k, v = qkv.split([576, 192, 192], dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q.reshape(rows, 9, 64), k.reshape(rows, 3, 64), cos, sin,
                                          unsqueeze_dim=1)
    v_before = v.clone()
    cpu_ops.rotary_(q.view(rows, 9, 64), cos, sin)
    cpu_ops.rotary_(k.view(rows, 3, 64), cos, sin)
    assert torch.equal(q.view(rows, 9, 64), want_q) and torch.equal(k.view(rows, 3, 64), want_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("rows", [1, 17, 1024])
def test_store_rows_writes_strided_rows_at_their_slots_like_index_copy(rows):
    """A step's k and v are column slices of one packed [T, q + k + v] product (strided rows)
    written to scattered cache slots: the same bytes as ``index_copy_``, nothing else touched."""
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 9 * 64 + 2 * 3 * 64, generator=g)
    k = qkv[:, 576:768].view(rows, 3, 64)
    slots = torch.randperm(4096, generator=g)[:rows]
    cache = torch.randn(4096, 3, 64, generator=g)
    want = cache.clone().index_copy_(0, slots, k)
    cpu_ops.store_rows(cache, slots, k)
    assert torch.equal(cache, want)


def test_store_rows_refuses_a_slot_outside_the_cache_before_writing():
    cache, src = torch.zeros(8, 2, 4), torch.ones(3, 2, 4)
    with pytest.raises(RuntimeError, match="slot 8 outside"):
        cpu_ops.store_rows(cache, torch.tensor([0, 8, 1]), src)
    with pytest.raises(RuntimeError, match="slot -1 outside"):
        cpu_ops.store_rows(cache, torch.tensor([2, 3, -1]), src)
    assert not cache.any()                          # checked before any row is written
    with pytest.raises(RuntimeError, match="int64"):
        cpu_ops.store_rows(cache, torch.tensor([0, 1, 2], dtype=torch.int32), src)
    with pytest.raises(RuntimeError, match="heads and dims contiguous"):
        cpu_ops.store_rows(cache, torch.tensor([0, 1]), torch.ones(2, 4, 2).transpose(1, 2))


def test_bad_inputs_are_refused_with_a_message():
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.rms_norm(torch.ones(2, 8, dtype=torch.float64), w, 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="even D"):
        cpu_ops.rotary_(torch.ones(2, 1, 7), torch.ones(2, 7), torch.ones(2, 7))


def test_the_builtin_models_take_the_fused_path():
    from kvharbor import LLM

    for name in ("kvharbor/tiny-llama", "kvharbor/tiny-qwen2"):
        assert LLM(model=name, num_kv_blocks=64).engine.runner.fast.fused, name
