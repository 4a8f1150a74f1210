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


@pytest.mark.parametrize("rows, inter", [(1, 1536), (5, 37), (700, 64)])
def test_silu_mul_matches_torch_on_both_halves_of_one_product(rows, inter):
    """silu(gate) * up from the gate and up halves of one [rows, 2 * inter] product, as
    transformers' MLP computes it from two products; inter 37 leaves a tail past the vectors.
    Gates span the range where the sigmoid flips between its two forms and saturates."""
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 8
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 30.0, -30.0])
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), want, atol=1e-6, rtol=1e-6)


def test_bad_inputs_are_refused_with_a_message():
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.rms_norm(torch.ones(2, 8, dtype=torch.float64), w, 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="even D"):
        cpu_ops.rotary_(torch.ones(2, 1, 7), torch.ones(2, 7), torch.ones(2, 7))
    with pytest.raises(RuntimeError, match="2 \\* inter"):
        cpu_ops.silu_mul(torch.ones(4, 6).t())                  # not contiguous


def test_the_builtin_models_take_the_fused_path():
    from kvharbor import LLM
    from kvharbor.engine.fast_model import PackedLayer

    for name in ("kvharbor/tiny-llama", "kvharbor/tiny-qwen2"):
        fast = LLM(model=name, num_kv_blocks=64).engine.runner.fast
        assert fast.fused, name
        # gate and up as one product, SiLU-multiplied in C++
        assert all(isinstance(p, PackedLayer) and p.gate_up is not None for p in fast.projections), name
