"""Packed oneDNN linears (the CPU model path's projections) against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvharbor.kernels import cpu_gemv, cpu_linear
from kvharbor.kernels.cpu_linear import PackedLinear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 32, 129, 2048])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    lin = PackedLinear(w, b)
    assert lin.packed is None and lin.weight.data_ptr() == w.data_ptr()   # kept, no copy
    out = lin(x)
    assert lin.packed is not None                  # oneDNN's copy, made by its first use
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@needs_onednn
def test_stacked_outputs_sit_side_by_side_in_order():
    """q/k/v (and gate/up) share one packed matrix: each slice is its own layer's product."""
    torch.manual_seed(0)
    q, k, v = torch.nn.Linear(16, 24), torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 8)
    x = torch.randn(7, 16)
    out = PackedLinear.stack(q, k, v)(x)
    with torch.no_grad():
        for part, m in zip(out.split([24, 8, 8], dim=-1), (q, k, v)):
            torch.testing.assert_close(part, m(x), atol=1e-5, rtol=1e-5)


def test_opt_out_and_other_dtypes_keep_f_linear(monkeypatch):
    w, x = torch.randn(12, 8), torch.randn(3, 8)
    monkeypatch.setenv("KVH_CPU_LINEAR", "torch")
    lin = PackedLinear(w)
    assert lin.packed is None
    assert torch.equal(lin(x), F.linear(x, w))
    monkeypatch.delenv("KVH_CPU_LINEAR")
    assert not cpu_linear.available(w.to(torch.bfloat16))


def test_row_buckets_cover_every_count_with_bounded_shapes_and_padding():
    counts = range(1, 2049)
    padded = [cpu_linear.padded_rows(n) for n in counts]
    assert all(p >= n for n, p in zip(counts, padded))
    assert len(set(padded)) <= 64                       # shapes oneDNN builds per weight
    assert all(p - n <= 7 for n, p in zip(counts, padded) if n <= 128)
    assert all((p - n) / n <= 0.25 for n, p in zip(counts, padded) if n > 128)
    assert cpu_linear.padded_rows(4000) % 256 == 0


@pytest.mark.parametrize("rows", [3, 9, 130, 600])
def test_padded_rows_give_the_same_rows_as_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    x = torch.randn(rows, 40, generator=g)
    out = cpu_linear.PackedLinear(w, b)(x)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def _onednn(lin: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """The packed product of ``x`` (padded as the packed path pads it)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight)
    y = torch.ops.mkldnn._linear_pointwise(cpu_linear.pad_rows(x), packed, lin.bias, "none", [], "")
    return y[:x.shape[0]]


def _recorded(monkeypatch) -> list[str]:
    """The products ``PackedLinear`` calls from now on, by name: ``gemv`` (cpu_gemv's kernel),
    ``blas`` (MKL's packed GEMM, or ``F.linear`` before its copy is made), ``onednn``. (On an
    AVX2 CPU oneDNN's small products sum in the kernel's order: equal outputs, so the test
    asks which ran.)"""
    calls = []

    def recording(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(cpu_gemv, "few_rows", recording("gemv", cpu_gemv.few_rows))
    monkeypatch.setattr(PackedLinear, "blas", recording("blas", PackedLinear.blas))
    monkeypatch.setattr(PackedLinear, "onednn", recording("onednn", PackedLinear.onednn))
    return calls


@needs_onednn
def test_rows_up_to_few_rows_take_the_few_row_product_and_the_rest_onednn(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1536, 576, generator=g), torch.randn(1536, generator=g)
    lin = PackedLinear(w, b)
    lin.use_few_rows(4)
    assert (lin.mkl is not None) == cpu_linear.mkl_available()   # MKL's packed copy, made now
    assert (lin.panels is not None) == cpu_gemv.available()      # and the own kernel's
    calls = _recorded(monkeypatch)
    for rows in (1, 2, 4, 5, 9):
        x = torch.randn(rows, 576, generator=g)
        calls.clear()
        out = lin(x)
        want = "onednn" if rows > 4 else "blas" if rows == 1 or lin.panels is None else "gemv"
        assert calls == [want], rows            # 1 row: MKL's; from 2: the own kernel's
        torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        assert torch.equal(out, _onednn(lin, x) if rows > 4 else lin.few(x))
        assert lin.pad(x).shape[0] == (rows if rows <= 4 else cpu_linear.padded_rows(rows))
        if lin.mkl is not None and rows == 1:
            assert torch.equal(out, torch.ops.mkl._mkl_linear(x, lin.mkl, w, b, 1))
    lin.use_few_rows(1)
    assert lin.panels is None and (lin.mkl is not None) == cpu_linear.mkl_available()
    lin.use_few_rows(0)
    assert lin.mkl is None                         # the copies go with the choice
    x = torch.randn(1, 576, generator=g)
    calls.clear()
    assert torch.equal(lin(x), _onednn(lin, x)) and calls == ["onednn"]


@needs_onednn
@pytest.mark.skipif(not cpu_gemv.available(), reason="cpu_gemv not built on this CPU")
def test_one_row_takes_the_kernel_from_gemv_from_1_and_then_needs_no_mkl_copy(monkeypatch):
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(1536, 576, generator=g), torch.randn(1536, generator=g)
    lin = PackedLinear(w, b)
    lin.use_few_rows(4, gemv_from=1)
    assert lin.panels is not None and lin.mkl is None          # no row count takes MKL's
    calls = _recorded(monkeypatch)
    for rows in (1, 3):
        x = torch.randn(rows, 576, generator=g)
        calls.clear()
        torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        assert calls == ["gemv"], rows
    lin.use_many_rows(40)                          # the many-row product still makes MKL's
    assert (lin.mkl is not None) == cpu_linear.mkl_available()
    lin.use_many_rows(0)
    # A weight the kernel cannot take (not whole panels) keeps MKL's for its few rows.
    odd = PackedLinear(torch.randn(cpu_gemv.panel() * 3 // 2, 576, generator=g))
    odd.use_few_rows(4, gemv_from=1)
    assert odd.panels is None and (odd.mkl is not None) == cpu_linear.mkl_available()
    calls.clear()
    odd(torch.randn(1, 576, generator=g))
    assert calls == ["blas"]
    lin.use_few_rows(4)                            # from 2 rows again: 1 row is MKL's
    assert lin.panels is not None and (lin.mkl is not None) == cpu_linear.mkl_available()
    calls.clear()
    lin(torch.randn(1, 576, generator=g))
    assert calls == ["blas"]


@needs_onednn
def test_few_rows_is_the_count_up_to_which_the_few_row_product_saves_the_most_time(monkeypatch):
    lins = [PackedLinear(torch.randn(64, 32)) for _ in range(3)]
    seen = []
    monkeypatch.setattr(cpu_linear, "_gemv_from", lambda sample: 2)   # its own test below

    def ratios(table):
        def best_pass(few, onednn):
            seen.append(len(few))
            return table[len(seen) - 1]
        return best_pass

    # Past 2 rows only where the own kernel is built (MKL alone was no faster there in the engine).
    counts = cpu_linear.FEW_ROW_COUNTS if cpu_gemv.available() else (1, 2)
    assert cpu_linear.FEW_ROW_COUNTS == (1, 2, 4, 8, 16, 32, 64)
    n = len(counts)
    # Each table: few-row / oneDNN time at each count.
    cases = [([0.6] * n, counts[-1]), ([0.6, 0.7] + [1.0] * (n - 2), 2),   # a tie: the smaller
             ([1.1, 1.2] + [0.9] * (n - 2), 0 if n == 2 else counts[-1]),
             ([1.05] * n, 0), ([0.6] * (n - 1) + [1.1], counts[-2])]
    if n > 2:   # one count a hair slower between faster ones: still past it
        cases.append(([0.5, 0.6, 0.7, 0.8, 1.01, 0.85, 0.9], 64))
        cases.append(([0.5, 0.6, 1.4, 0.9, 0.95, 1.2, 1.2], 2))
    for table, want in cases:
        seen.clear()
        monkeypatch.setattr(cpu_linear, "_best_pass", ratios(table))
        assert cpu_linear.few_rows(lins) == want, table
        assert seen == [3] * n                                              # every count timed
        assert all(lin.few_rows == want for lin in lins)
    # The sample stops at the byte budget (at least one weight).
    seen.clear()
    monkeypatch.setattr(cpu_linear, "_best_pass", ratios([0.5] * n))
    assert cpu_linear.few_rows(lins, budget_bytes=1) == counts[-1] and seen == [1] * n
    # A few-row product that computes something else is never taken, however fast.
    seen.clear()
    monkeypatch.setattr(PackedLinear, "few", lambda self, x: F.linear(x, self.weight) + 1.0)
    assert cpu_linear.few_rows(lins) == 0 and seen == []
    # The override skips the timing.
    monkeypatch.setenv("KVH_CPU_FEW_ROWS", "2")
    assert cpu_linear.few_rows(lins) == 2 and seen == []


@needs_onednn
@pytest.mark.skipif(not cpu_gemv.available(), reason="cpu_gemv not built on this CPU")
def test_one_row_takes_the_kernel_where_it_beat_the_one_row_blas_product(monkeypatch):
    lins = [PackedLinear(torch.randn(64, 32)) for _ in range(3)]
    calls = []

    def best_pass(ratio, one_row=True, want=None):
        def timed(a, b):
            calls.append(len(a))
            if want is not None and len(calls) == 2:   # the few-row counts time the chosen 1-row product
                assert all(lin.gemv_from == want for lin in lins)
            if one_row and len(calls) == 1:        # the 1-row choice: the kernel against MKL's
                (lin, x), (_, y) = a[0].__defaults__, b[0].__defaults__   # each call's (lin, x)
                assert x.shape == (1, 32) and lin is lins[0]
                assert torch.equal(a[0](), cpu_gemv.few_rows(x, lin.panels, None))
                assert torch.equal(b[0](), lin.blas(y))
                return ratio
            lin, x = a[0].__defaults__
            if x.shape[0] >= lin.gemv_from:        # from there what is timed is the kernel's
                assert lin.panels is not None
            return 0.5                             # the few-row counts: every one saves
        return timed

    packs = []
    real_pack = cpu_gemv.pack
    monkeypatch.setattr(cpu_gemv, "pack", lambda w: packs.append(w) or real_pack(w))
    for ratio, want in ((0.7, 1), (0.99, 1), (1.0, 2), (1.3, 2)):
        calls.clear()
        packs.clear()
        lins[:] = [PackedLinear(torch.randn(64, 32)) for _ in range(3)]
        monkeypatch.setattr(cpu_linear, "_best_pass", best_pass(ratio, want=want))
        assert cpu_linear.few_rows(lins) == 64
        assert len(packs) == len(lins), ratio      # each weight packed once, whichever 1-row product
        assert calls[0] == 3 and all(lin.gemv_from == want for lin in lins), ratio
        x = torch.randn(1, 32)
        one_row = cpu_gemv.few_rows(x, lins[0].panels, None) if want == 1 else lins[0].blas(x)
        assert torch.equal(lins[0](x), one_row)
        assert (lins[0].mkl is None) == (want == 1 or not cpu_linear.mkl_available())
    # A kernel that computes something else at one row is not timed there, however fast.
    calls.clear()
    monkeypatch.setattr(cpu_linear, "_best_pass", best_pass(0.1, one_row=False))
    real = cpu_gemv.few_rows
    monkeypatch.setattr(cpu_gemv, "few_rows",
                        lambda x, p, b: real(x, p, b) + (1.0 if x.shape[0] == 1 else 0.0))
    cpu_linear.few_rows(lins)
    assert all(lin.gemv_from == 2 for lin in lins) and calls == [3] * len(cpu_linear.FEW_ROW_COUNTS)
    # The override skips that timing.
    monkeypatch.setattr(cpu_gemv, "few_rows", real)
    monkeypatch.setenv("KVH_CPU_GEMV_FROM", "1")
    monkeypatch.setattr(cpu_linear, "_best_pass", best_pass(0.1, one_row=False))
    calls.clear()
    cpu_linear.few_rows(lins)
    assert all(lin.gemv_from == 1 for lin in lins) and calls == [3] * len(cpu_linear.FEW_ROW_COUNTS)


@needs_onednn
@pytest.mark.skipif(not cpu_linear.mkl_available(), reason="torch built without MKL")
def test_rows_from_many_rows_take_mkl_unpadded_and_the_rest_onednn():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 576, generator=g), torch.randn(96, generator=g)
    lin = PackedLinear(w, b)
    lin.use_many_rows(40)
    assert lin.mkl is not None                     # MKL's copy, made for the many-row product
    for rows in (9, 39, 40, 41, 200):
        x = torch.randn(rows, 576, generator=g)
        blas = torch.ops.mkl._mkl_linear(x, lin.mkl, w, b, rows)
        assert not torch.equal(blas, _onednn(lin, x))   # the two sum in different orders
        torch.testing.assert_close(blas, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        mkl = rows >= 40
        assert torch.equal(lin(x), blas if mkl else _onednn(lin, x)), rows
        assert lin.pad(x).shape[0] == (rows if mkl else cpu_linear.padded_rows(rows))
    lin.use_few_rows(1)
    lin.use_many_rows(0)
    assert lin.mkl is not None                     # still the 1-row product's
    lin.use_few_rows(0)
    assert lin.mkl is None and lin.pad(torch.randn(41, 576)).shape[0] == cpu_linear.padded_rows(41)


@needs_onednn
@pytest.mark.skipif(not cpu_linear.mkl_available(), reason="torch built without MKL")
def test_many_rows_is_the_count_from_which_mkl_saves_the_most_time(monkeypatch):
    lins = [PackedLinear(torch.randn(64, 32)) for _ in range(3)]
    seen = []

    def ratios(table):
        def best_pass(blas, onednn, rounds=3):
            seen.append(len(blas))
            assert lins[0].mkl is not None          # what is timed is MKL's product
            return table[len(seen) - 1]
        return best_pass

    assert sorted(cpu_linear.MANY_ROW_COUNTS) == [32, 128, 512]   # each table: MKL / oneDNN there
    for table, want in (([0.95, 0.9, 0.8], 32), ([1.0, 0.9, 0.8], 128),   # a tie: the larger count
                        ([0.96, 0.92, 1.01], 32),    # one count a hair slower: still 32 on
                        ([1.3, 0.9, 1.02], 128), ([1.2, 1.2, 0.9], 512),
                        ([0.5, 1.1, 0.8], 32), ([0.9, 1.05, 1.06], 0), ([1.0, 1.0, 1.0], 0)):
        seen.clear()
        monkeypatch.setattr(cpu_linear, "_best_pass", ratios(table))
        assert cpu_linear.many_rows(lins) == want, table
        assert seen == [3] * 3                                    # every count timed
        assert all(lin.many_rows == want and (lin.mkl is not None) == bool(want) for lin in lins)
    # The sample stops at the byte budget (at least one weight).
    seen.clear()
    monkeypatch.setattr(cpu_linear, "_best_pass", ratios([0.5] * 3))
    assert cpu_linear.many_rows(lins, budget_bytes=1) == 32 and seen == [1] * 3
    # An MKL product that computes something else is never taken, however fast.
    seen.clear()
    monkeypatch.setattr(PackedLinear, "blas", lambda self, x: F.linear(x, self.weight) + 1.0)
    assert cpu_linear.many_rows(lins) == 0 and seen == []
    # The override skips the timing; 0 keeps every product on oneDNN.
    seen.clear()
    monkeypatch.setenv("KVH_CPU_MANY_ROWS", "0")
    assert cpu_linear.many_rows(lins) == 0 and seen == [] and all(lin.mkl is None for lin in lins)


@needs_onednn
@pytest.mark.skipif(not cpu_linear.mkl_available(), reason="torch built without MKL")
def test_settle_keeps_onednn_copies_only_where_a_row_count_takes_them():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 576, generator=g), torch.randn(96, generator=g)
    lins = [PackedLinear(w, b) for _ in range(4)]
    lins[0](torch.randn(300, 576, generator=g))    # a first use (a calibration's) makes one
    assert lins[0].packed is not None and all(lin.packed is None for lin in lins[1:])
    for lin, (few, many) in zip(lins, ((8, 9), (8, 4), (8, 10), (0, 32))):
        lin.use_few_rows(few)
        lin.use_many_rows(many)
    # Only the first two are covered: rows 1-8 few-row, 9+ (4+) MKL's; the third sends 9 rows
    # to oneDNN, the fourth every count under 32.
    assert cpu_linear.settle(lins) == 2 * w.numel() * 4
    assert [lin.packed is None for lin in lins] == [True, True, False, False]   # made up front
    for lin in lins:
        for rows in (0, 1, 8, 9, 10, 31, 32, 200):
            x = torch.randn(rows, 576, generator=g)
            torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
        x = torch.randn(2, 5, 576, generator=g)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    assert [lin.packed is None for lin in lins] == [True, True, False, False]   # none made since
    # Counts that reach oneDNN again make its copy again, on its first use.
    lins[0].use_many_rows(0)
    x = torch.randn(20, 576, generator=g)
    assert torch.equal(lins[0](x), _onednn(lins[0], x)) and lins[0].packed is not None
    assert cpu_linear.settle(lins[:1]) == 0
