"""The decode-sized product of our own (cpu_gemv) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvharbor.kernels import cpu_gemv

needs_kernel = pytest.mark.skipif(not cpu_gemv.available(),
                                  reason="cpu_gemv needs a compiler targeting AVX-512")


@needs_kernel
@pytest.mark.parametrize("rows", [*range(cpu_gemv.MIN_ROWS, 10), 16, 17, 33])
@pytest.mark.parametrize(("n", "k", "bias"), [(96, 40, True), (64, 33, False), (576, 576, True),
                                              (64, 300, True)])
def test_row_counts_match_f_linear(rows, n, k, bias):
    """Every register group size (1-8 rows), several groups with a partial last one, K in
    one block and in several with a partial last block (the sums carried across blocks, the
    bias added once), odd and even K, with and without a bias."""
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
    panels = cpu_gemv.pack(w)
    assert panels.shape == (64 // cpu_gemv.PANEL, 3, cpu_gemv.PANEL)
    assert torch.equal(panels, w.reshape(-1, cpu_gemv.PANEL, 3).transpose(1, 2))


def test_only_whole_panels_of_float32_cpu_weights_are_usable():
    assert not cpu_gemv.usable(torch.randn(cpu_gemv.PANEL + 16, 8))
    assert not cpu_gemv.usable(torch.randn(cpu_gemv.PANEL, 8, dtype=torch.float64))
    assert cpu_gemv.usable(torch.randn(cpu_gemv.PANEL * 2, 8)) == cpu_gemv.available()


@needs_kernel
def test_row_counts_it_does_not_take_are_refused():
    w = cpu_gemv.pack(torch.randn(64, 8))
    for rows in (0, cpu_gemv.MIN_ROWS - 1):
        with pytest.raises(RuntimeError, match="2 rows or more"):
            cpu_gemv.few_rows(torch.randn(rows, 8), w, None)
