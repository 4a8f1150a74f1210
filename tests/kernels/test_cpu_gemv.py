"""The decode-sized product of our own (cpu_gemv) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import cpu_model
from kvharbor.kernels import cpu_gemv

needs_kernel = pytest.mark.skipif(not cpu_gemv.available(),
                                  reason="cpu_gemv needs a compiler targeting AVX2 with FMA or AVX-512")


@needs_kernel
@pytest.mark.parametrize("rows", [*range(1, 10), 12, 13, 16, 17, 33])
@pytest.mark.parametrize(("n", "k", "bias"), [(96, 40, True), (64, 33, False), (576, 576, True),
                                              (64, 300, True)])
def test_row_counts_match_f_linear(rows, n, k, bias):
    """Every register group size (1-8 rows with AVX-512, 1-6 with AVX2), several groups with a
    partial last one, K in one block and in several with a partial last block (the sums
    carried across blocks, the bias added once), odd and even K, with and without a bias."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    out = cpu_gemv.few_rows(x, cpu_gemv.pack(w), b)
    assert out.shape == (rows, n)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@needs_kernel
def test_panels_hold_each_weight_once_in_panel_order():
    w = torch.arange(64 * 3, dtype=torch.float32).reshape(64, 3)
    panels, p = cpu_gemv.pack(w), cpu_gemv.panel()
    assert p == (32 if "avx512f" in (cpu_model() or "") else 16)   # two vectors of the widest ISA
    assert panels.shape == (64 // p, 3, p)
    assert torch.equal(panels, w.reshape(-1, p, 3).transpose(1, 2))


def test_only_whole_panels_of_float32_cpu_weights_are_usable():
    p = cpu_gemv.panel() or 16
    assert not cpu_gemv.usable(torch.randn(p + p // 2, 8))
    assert not cpu_gemv.usable(torch.randn(p, 8, dtype=torch.float64))
    assert cpu_gemv.usable(torch.randn(p * 2, 8)) == cpu_gemv.available()


@needs_kernel
def test_an_input_of_no_rows_is_refused():
    w = cpu_gemv.pack(torch.randn(64, 8))
    with pytest.raises(RuntimeError, match="1 row or more"):
        cpu_gemv.few_rows(torch.randn(0, 8), w, None)
