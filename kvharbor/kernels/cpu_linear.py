"""Linear layers on the CPU with their weights packed once for oneDNN.

``F.linear`` hands an fp32 ``[out, in]`` weight to the BLAS on every call, which re-blocks it
for its inner kernel each time; at decode batch sizes (8-128 rows) that re-blocking is most of
the call. oneDNN can take the weight already in its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the same ops inductor uses for frozen CPU
graphs), so the weights are packed once when the model path is built. Measured on this
project's 2-core AMD EPYC VM (fp32, single calls, weights cycled out of cache):
``[32, 576] x [576, 1536]`` 0.55 -> 0.33 ms, ``[2048, 576] x [576, 1536]`` 29.7 -> 18.1 ms,
the 49,152-row LM head at 32 rows 25.9 -> 12.3 ms.

Same math as ``F.linear`` up to float rounding (oneDNN sums in another order: ~1e-7
relative), bounded by the kernel tests; the engine's greedy-exact tests compare the tokens.
Only float32 on the CPU with oneDNN present: other dtypes and devices keep ``F.linear``.
Packed weights are copies: the model's own weights (the tests' transformers oracle) stay.

Below 4 rows the BLAS behind ``F.linear`` switches to its matrix-vector kernel, which reads
the plain weight once at the memory's pace; whether that beats oneDNN's blocked product
depends on the CPU. On a 2-core Intel Xeon with AVX-512 and AMX, the 135M model's 30 layers
of products (424 MB, fp32) took 33.9 ms at 1 row through ``F.linear`` and 53.3 ms packed (8
padded rows: 52.6 ms); at 4 rows 62.2 vs 55.6 ms. An earlier session's AMD EPYC VM showed no
gain. So :func:`gemv_rows` times both on the model's own weights once, when the model path
is built, and the products keep ``F.linear`` up to the row count where it was faster.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F


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
    weight cannot be packed, and uses it for inputs of at most ``gemv_rows`` rows (0 until
    :func:`gemv_rows` has measured it).

    The plain weight is kept for that path: the caller's own tensor (no copy) when it is
    contiguous, as a module's weight or a stack whose modules are views of it is.
    """

    __slots__ = ("weight", "bias", "packed", "out_features", "gemv_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.out_features = self.weight.shape[0]
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(self.weight)
                       if available(self.weight) else None)
        self.gemv_rows = 0

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

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, in]`` padded as this product pads it (not at all where it takes
        ``F.linear``): callers that feed several products pad once."""
        return x if self.packed is None or x.shape[0] <= self.gemv_rows else pad_rows(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]``."""
        rows = x.shape[0]
        if self.packed is None or (x.dim() == 2 and rows <= self.gemv_rows):
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2 and rows:                         # see padded_rows: bounded shapes
            x = pad_rows(x)
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y[:rows] if y.shape[0] != rows else y


GEMV_MAX_ROWS = 3       # the BLAS's matrix-vector range (its fp32 GEMM switches at 4 rows)


def gemv_rows(linears: Sequence[PackedLinear], budget_bytes: int = 256 << 20) -> int:
    """The largest row count ``r`` (0 to ``GEMV_MAX_ROWS``) at which ``F.linear`` was faster
    than the packed product at every count from 1 to ``r``, timed on ``linears`` in order
    (those that fit ``budget_bytes`` of weights, at least one: a model's first layers and
    its LM head read the way a step reads them). ``KVH_CPU_GEMV_ROWS`` sets it instead (A/B
    runs; 0: always packed). About 20 passes over the sample: ~1 s for the 135M model.
    """
    forced = os.environ.get("KVH_CPU_GEMV_ROWS")
    if forced is not None:
        return max(0, min(GEMV_MAX_ROWS, int(forced)))
    sample, total = [], 0
    for lin in linears:
        if lin.packed is None:
            continue
        size = lin.weight.numel() * lin.weight.element_size()
        if sample and total + size > budget_bytes:
            break
        sample.append(lin)
        total += size
    if not sample:
        return 0
    for rows in range(1, GEMV_MAX_ROWS + 1):
        xs = [torch.randn(rows, lin.weight.shape[1]) for lin in sample]
        plain = [(lambda lin=lin, x=x: F.linear(x, lin.weight, lin.bias)) for lin, x in zip(sample, xs)]
        packed = [(lambda lin=lin, x=pad_rows(x): torch.ops.mkldnn._linear_pointwise(
            x, lin.packed, lin.bias, "none", [], "")) for lin, x in zip(sample, xs)]
        if _best_pass(plain, packed) >= 1.0:
            return rows - 1
    return GEMV_MAX_ROWS


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
