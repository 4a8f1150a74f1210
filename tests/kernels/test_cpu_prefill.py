"""The C++ causal prefill kernel against attention computed in float64.

Lengths cross the kernel's query blocks (64 tokens), key panels (64 keys, AVX-512) and key
chunks (256 keys, the BLAS path); key rows the queries may not read are NaN, so a read past a
row's last key shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch

from kvharbor.kernels import cpu_prefill
from kvharbor.kernels.cpu_attention import paged_attention_cpu, plan_attention

from .batch import DEVICE, make_batch

pytestmark = pytest.mark.skipif(not cpu_prefill.available(), reason="no C++ compiler to build the kernel")


def reference(q, k, v, past, scale):
    """softmax(scale q k^T) v in float64, query i seeing keys [0, past + i]."""
    t, h, d = q.shape
    hkv = k.shape[1]
    keys = past + t
    kk = k[:keys].double().repeat_interleave(h // hkv, 1)           # [L, H, D]
    vv = v[:keys].double().repeat_interleave(h // hkv, 1)
    s = torch.einsum("thd,lhd->htl", q.double(), kk) * scale
    allowed = torch.arange(keys)[None, :] <= past + torch.arange(t)[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("htl,lhd->thd", s.softmax(-1), vv)


def packed(t, h, hkv, d, extra_keys=0, seed=0):
    """q, k, v as views of one packed qkv product (the model path's strides); k/v carry
    ``extra_keys`` rows before this step's (a cached prefix) and one NaN row after it."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g)
    q = qkv[:, :h * d].view(t, h, d)
    k = torch.randn(extra_keys + t + 1, hkv, d, generator=g)
    v = torch.randn(extra_keys + t + 1, hkv, d, generator=g)
    k[extra_keys + t:] = float("nan")
    v[extra_keys + t:] = float("nan")
    return q, k, v


@pytest.mark.parametrize("t, past", [(1, 0), (2, 0), (63, 0), (64, 0), (65, 0), (300, 0), (600, 0),
                                     (1, 5), (70, 255), (200, 257), (64, 1000)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 20)],
                         ids=["gqa3-d64", "mha-d32", "mqa-d128", "gqa3-d20"])
def test_matches_float64_attention(t, past, heads, kv_heads, head_dim):
    q, k, v = packed(t, heads, kv_heads, head_dim, past, seed=t + past)
    out = torch.full((t, heads, head_dim), float("nan"))
    scale = head_dim ** -0.5
    cpu_prefill.causal_attention(q, k, v, out, past, scale)
    torch.testing.assert_close(out.double(), reference(q, k, v, past, scale), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_gives_the_same_output(threads):
    """Blocks are split over threads by their share of the keys; every split covers every
    (KV head, query block) exactly once, so the outputs do not depend on the thread count."""
    q, k, v = packed(333, 9, 3, 64, 40, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.full(q.shape, float("nan"))
        cpu_prefill.causal_attention(q, k, v, one, 40, 0.125)
        torch.set_num_threads(threads)
        many = torch.full(q.shape, float("nan"))
        cpu_prefill.causal_attention(q, k, v, many, 40, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_writes_only_its_rows_of_a_strided_output():
    """The output may be a slice of the step's output: the rows around it stay untouched."""
    q, k, v = packed(70, 4, 2, 32, 0, seed=1)
    full = torch.full((90, 4, 32), 7.0)
    cpu_prefill.causal_attention(q, k, v, full[10:80], 0, 32 ** -0.5)
    assert (full[:10] == 7).all() and (full[80:] == 7).all()
    torch.testing.assert_close(full[10:80].double(), reference(q, k, v, 0, 32 ** -0.5), atol=2e-5, rtol=2e-5)


def test_rejects_inputs_it_cannot_read():
    q, k, v = packed(8, 4, 2, 32)
    out = torch.empty(8, 4, 32)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_prefill.causal_attention(q.double(), k, v, out, 0, 1.0)
    with pytest.raises(RuntimeError, match="shapes"):
        cpu_prefill.causal_attention(q, k[:8], v[:8], out, 1, 1.0)      # keys end before past + T
    assert not cpu_prefill.usable(q.transpose(1, 2))                    # dims not contiguous


@pytest.mark.skipif(DEVICE.type != "cpu", reason="make_batch builds on the GPU there; the kernel is CPU-only")
@pytest.mark.parametrize("window", [None, 96])
def test_planned_step_takes_the_kernel_where_no_window_cuts(window, monkeypatch):
    """In a step with a fresh 300-token prefill and 150 tokens after a 200-token cached prefix,
    the planned attention runs those through the kernel (none when a window hides keys) and
    gives the SDPA path's result."""
    batch = make_batch([300, 150, 1], [300, 350, 90], heads=9, kv_heads=3, head_dim=64,
                       block_size=16, dtype=torch.float32, seed=5)
    calls = []
    real = cpu_prefill.causal_attention
    monkeypatch.setattr(cpu_prefill, "causal_attention", lambda *a: calls.append(a[4]) or real(*a))

    def attend():
        q, c = batch.query, batch.cache
        qsl, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
        plan = plan_attention(batch.block_tables, lens, qsl, c.key.shape[1], window)
        starts = [sum(lens[:b]) for b in range(len(lens))]
        rows = torch.cat([torch.arange(s + n - (qsl[b + 1] - qsl[b]), s + n)
                          for b, (s, n) in enumerate(zip(starts, lens))])
        return paged_attention_cpu(q, batch.key[rows], batch.value[rows], c, plan, 0.125)

    with_kernel = attend()
    assert calls == ([] if window else [0, 200])
    monkeypatch.setenv("KVH_CPU_PREFILL", "0")
    calls.clear()
    without = attend()
    assert calls == []
    torch.testing.assert_close(with_kernel, without, atol=2e-5, rtol=2e-5)
