"""A few-row product of our own for the CPU: ``y = x @ W.T + b`` for 2 to 8 rows of ``x``.

A decode step at a handful of rows reads every weight for a few dot products each, so its
products run at the memory bandwidth the kernel can draw, and the BLAS kernels draw it poorly
past one row. On this project's 2-core Xeon VM (AVX-512, weights in huge pages) the 135M
model's 30 layers and LM head (537 MB) took, at 1 / 2 / 4 / 8 rows: MKL's packed GEMM
21.6 / 39.1 / 46.2 / 64.2 ms, oneDNN (rows padded to 8) 27.9 / 44.4 / 44.7 / 54.0 ms, this
kernel 27.1 / 34.7 / 34.3 / 52.3 ms (one process, passes alternating, best of 6; the VM's
speed drifts, so read the columns of one row together; the 1-row figure is of a variant since
removed). So ``cpu_linear`` keeps MKL's at one row and takes this one from two.

The weight ``[N, K]`` is packed once into panels of 32 outputs, ``[N / 32, K, 32]``, so a
thread streams one panel front to back (128 contiguous bytes per ``k``, software-prefetched
320 ``k``, 40 KB, ahead: in a first version with 64-wide panels, 2 rows took 49.0 ms without
a prefetch and 25-35 ms with one) while the ``M`` rows of ``x`` stay in cache; per ``k`` it broadcasts ``x[m, k]`` and adds it times the panel's
32 weights (2 AVX-512 vectors) into ``M x 2`` vector accumulators, so every weight byte is read
once whatever ``M`` is. Panels are spread over torch's intra-op threads (32-wide panels split
the model's 576-, 960- and 3072-wide weights evenly over 2 threads; 64-wide ones did not).
Same math as ``F.linear`` up to float rounding (each output sums over ``k`` in order),
bounded by the kernel tests; the engine's greedy-exact tests compare the tokens.

AVX-512 only (the compiler must target it), ``N`` a multiple of 32, float32: :func:`usable`
says whether a weight can take it; elsewhere the few-row product stays MKL's
(``cpu_linear``). Built with the system C++ compiler on first use; ``KVH_CPU_GEMV=0``
disables it (for A/B runs).
"""

from __future__ import annotations

import torch

from .inline_cpp import InlineExtension

PANEL = 32          # outputs per packed panel: 2 AVX-512 vectors (the C++ side's P)
MIN_ROWS, MAX_ROWS = 2, 8      # rows one call takes (one row stays on MKL: cpu_linear)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

constexpr int64_t VECS = 2, P = 16 * VECS;   // AVX-512 vectors and outputs per panel
constexpr int64_t AHEAD = 320;               // k rows prefetched ahead (40 KB)

bool built_with_avx512() {
#if defined(__AVX512F__) && !defined(KVH_NO_AVX512)
  return true;
#else
  return false;
#endif
}

// w [N, K] -> [N / P, K, P]: panel p holds outputs P p .. P p + P - 1, k-major.
torch::Tensor pack(torch::Tensor w) {
  const int64_t N = w.size(0), K = w.size(1);
  auto out = torch::empty({N / P, K, P}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, N / P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < P; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * P + j] = src[(p * P + j) * K + k];
  });
  return out;
}

#if defined(__AVX512F__) && !defined(KVH_NO_AVX512)
// Rows [0, M) of y for panel p: y[m, P p + j] = sum_k x[m, k] w[p, k, j] (+ bias).
template <int M>
inline void panel(const float* x, int64_t K, const float* w, const float* bias, float* y,
                  int64_t ldy) {
  __m512 acc[M][VECS];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < VECS; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * P;
    for (int v = 0; v < VECS; ++v)
      _mm_prefetch(reinterpret_cast<const char*>(wk + AHEAD * P + v * 16), _MM_HINT_T0);
    __m512 wv[VECS];
    for (int v = 0; v < VECS; ++v) wv[v] = _mm512_loadu_ps(wk + v * 16);
    for (int m = 0; m < M; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * K + k]);
      for (int v = 0; v < VECS; ++v) acc[m][v] = _mm512_fmadd_ps(a, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < VECS; ++v) {
      __m512 r = acc[m][v];
      if (bias) r = _mm512_add_ps(r, _mm512_loadu_ps(bias + v * 16));
      _mm512_storeu_ps(y + m * ldy + v * 16, r);
    }
}

template <int M>
void rows(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t N) {
  at::parallel_for(0, N / P, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      panel<M>(x, K, w + p * K * P, bias ? bias + p * P : nullptr, y + p * P, N);
  });
}
#endif

// y [M, N] = x [M, K] @ W^T + bias, W packed by pack(); M in [2, 8].
torch::Tensor few_rows(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * P;
  TORCH_CHECK(M >= 2 && M <= 8, "cpu_gemv.few_rows takes 2 to 8 rows, got ", M);
  TORCH_CHECK(built_with_avx512(), "cpu_gemv was built without AVX-512");
  auto y = torch::empty({M, N}, x.options());
#if defined(__AVX512F__) && !defined(KVH_NO_AVX512)
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 2: rows<2>(xp, K, wp, bp, yp, N); break;
    case 3: rows<3>(xp, K, wp, bp, yp, N); break;
    case 4: rows<4>(xp, K, wp, bp, yp, N); break;
    case 5: rows<5>(xp, K, wp, bp, yp, N); break;
    case 6: rows<6>(xp, K, wp, bp, yp, N); break;
    default:                         // 7 or 8 rows: two passes keep the accumulators in registers
      rows<4>(xp, K, wp, bp, yp, N);
      if (M == 7) rows<3>(xp + 4 * K, K, wp, bp, yp + 4 * N, N);
      else rows<4>(xp + 4 * K, K, wp, bp, yp + 4 * N, N);
  }
#endif
  return y;
}
"""

_EXT = InlineExtension("kvharbor_cpu_gemv", _SOURCE, ["built_with_avx512", "pack", "few_rows"],
                       "KVH_CPU_GEMV")


def available() -> bool:
    """True when the kernel is built with AVX-512 (building it now if needed);
    ``KVH_CPU_GEMV=0`` disables it."""
    return _EXT.available() and _EXT.module.built_with_avx512()


def usable(weight: torch.Tensor) -> bool:
    """True when ``weight`` ``[N, K]`` can be packed for :func:`few_rows`: float32 on the CPU,
    ``N`` a multiple of :data:`PANEL`, and the kernel built with AVX-512."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[0] % PANEL == 0 and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as panels ``[N / 32, K, 32]`` (a copy; see :func:`usable`)."""
    return _EXT.module.pack(weight.contiguous())


def few_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` (:data:`MIN_ROWS` <= M <= :data:`MAX_ROWS`, float32,
    contiguous) and ``packed`` = :func:`pack` (``W``)."""
    return _EXT.module.few_rows(x.contiguous(), packed, bias)
