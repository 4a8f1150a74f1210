"""A decode-sized product of our own for the CPU: ``y = x @ W.T + b`` for a few rows of ``x``.

A decode step at a handful of rows reads every weight for a few dot products each, so its
products run at the memory bandwidth the kernel can draw, and the BLAS kernels draw it poorly
past one row. On this project's 2-core Xeon VM (AVX-512, weights in huge pages) the 135M
model's 30 layers and LM head (537 MB) took, at 1 / 2 / 4 / 8 rows: MKL's packed GEMM
21.6 / 39.1 / 46.2 / 64.2 ms, oneDNN (rows padded to 8) 27.9 / 44.4 / 44.7 / 54.0 ms, this
kernel 27.1 / 34.7 / 34.3 / 52.3 ms (one process, passes alternating, best of 6; the VM's
speed drifts, so read the columns of one row together; the 1-row figure is of an earlier
version). On the 2-core AMD EPYC VM (AVX2 and FMA, no AVX-512), with the AVX2 build, at
1 / 2 / 4 / 8 / 16 / 64 rows: MKL's 41.8 / 64.6 / 97.2 / 104.3 / 116.1 / 198.1 ms (MKL takes a
generic path on AMD), oneDNN 54.9 / 55.6 / 58.8 / 57.2 / 63.7 / 147.7 ms, this kernel 26.1 /
25.0 / 27.0 / 31.7 / 41.7 / 120.6 ms. So ``cpu_linear`` times, per CPU, whether one row takes
this kernel or MKL's (``_gemv_from``), and up to how many rows the few-row product reaches.

The weight ``[N, K]`` is packed once into panels of ``P`` outputs (two vectors: 32 with
AVX-512, 16 with AVX2), ``[N / P, K, P]``, so a thread streams one panel front to back (``P``
contiguous floats per ``k``, software-prefetched 40 KB ahead: in a first version with 64-wide
panels, 2 rows took 49.0 ms without a prefetch and 25-35 ms with one) while the ``M`` rows of
``x`` stay in cache; per ``k`` it broadcasts ``x[m, k]`` and adds it times the panel's ``P``
weights into ``M x 2`` vector accumulators, so every weight byte is read once whatever ``M``
is. Panels are spread over torch's intra-op threads (32-wide panels split the model's 576-,
960- and 3072-wide weights evenly over 2 threads; 64-wide ones did not). Past 8 rows with
AVX-512 (16 accumulators of the 32 registers), 6 with AVX2 (12 of 16), the rows go in groups
of that size, and a panel is read in blocks of 16 KB of ``k`` that every group sums over
before the next block streams in: the weights still come from memory once, the groups after
the first read the block from L1. The 135M model's 30 layers on the Xeon VM, one process,
best of 5, at 8 / 16 / 32 / 64 / 128 rows: this kernel 33.6 / 41.3 / 52.9 / 82.5 / 134.5 ms,
oneDNN 43.1 / 47.3 / 59.6 / 96.4 / 138.5 ms, MKL 49.2 / 54.2 / 59.8 / 87.9 / 123.3 ms (the
first version split 8 rows into two passes of 4: 52 ms). In the engine, decoding 8 / 16 / 32
requests at once: +16-53% / +3-29% / +0-18% tokens/s over the same kernel stopping at 4 rows
(two fresh processes each way, ABBA). Which row counts take it is timed per CPU
(``cpu_linear.few_rows``).
Same math as ``F.linear`` up to float rounding (each output sums over ``k`` in order),
bounded by the kernel tests; the engine's greedy-exact tests compare the tokens.

Needs a compiler targeting AVX2 with FMA (or AVX-512), ``N`` a multiple of :func:`panel`,
float32: :func:`usable` says whether a weight can take it; elsewhere the few-row product stays
MKL's (``cpu_linear``). Built with the system C++ compiler on first use; ``KVH_CPU_GEMV=0``
disables it (for A/B runs).
"""

from __future__ import annotations

import torch

from .inline_cpp import InlineExtension


_SOURCE = r"""
@ATEN_HEADERS@
@SIMD_MATH@

// A panel is VECS vectors of outputs: 32 with AVX-512, 16 with AVX2. A row group's
// accumulators (VECS per row) stay in registers beside the panel's VECS weights and a broadcast:
// 8 rows of the 32 AVX-512 registers, 6 of AVX2's 16.
#if defined(KVH_AVX512)
using V = V16;
constexpr int64_t GROUP = 8;
#elif defined(KVH_AVX2)
using V = V8;
constexpr int64_t GROUP = 6;
#endif
#if defined(KVH_AVX2)
constexpr int64_t VECS = 2, P = VECS * V::L;   // vectors and outputs per panel
constexpr int64_t AHEAD = 40960 / (4 * P);     // k rows prefetched ahead (40 KB)
constexpr int64_t KBLOCK = 16384 / (4 * P);    // k per block of a panel (16 KB) row groups share in L1
#else
constexpr int64_t P = 32;                      // only pack() runs (panel() says 0)
#endif

// Outputs per panel of the kernel as built; 0 where the compiler targets neither AVX2 with
// FMA nor AVX-512 (no product then).
int64_t panel() {
#if defined(KVH_AVX2)
  return P;
#else
  return 0;
#endif
}

// w [N, K] -> [N / P, K, P]: panel p holds outputs P p .. P p + P - 1, k-major.
at::Tensor pack(at::Tensor w) {
  const int64_t N = w.size(0), K = w.size(1);
  auto out = at::empty({N / P, K, P}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, N / P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < P; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * P + j] = src[(p * P + j) * K + k];
  });
  return out;
}

#if defined(KVH_AVX2)
// R rows of y, one panel's P outputs, summed over kn values of k: y[m, j] (+)= sum_k
// x[m, k] w[k, j] (+ bias at the last block). x and y advance by ldx and ldy per row; w is the
// panel at its first k. The accumulators start from y unless first, so blocks of k sum in
// order. Only the first row group prefetches (each 64-byte line of the panel AHEAD k on): the
// others read the block from L1.
template <int R, bool PREFETCH>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t kn, const float* bias,
                 float* y, int64_t ldy, bool first, bool last) {
  typename V::T acc[R][VECS];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < VECS; ++v)
      acc[m][v] = first ? V::set(0.f) : V::load(y + m * ldy + v * V::L);
  for (int64_t k = 0; k < kn; ++k) {
    const float* wk = w + k * P;
    if (PREFETCH)
      for (int64_t c = 0; c < P; c += 16)
        _mm_prefetch(reinterpret_cast<const char*>(wk + AHEAD * P + c), _MM_HINT_T0);
    typename V::T wv[VECS];
    for (int v = 0; v < VECS; ++v) wv[v] = V::load(wk + v * V::L);
    for (int m = 0; m < R; ++m) {
      const typename V::T a = V::set(x[m * ldx + k]);
      for (int v = 0; v < VECS; ++v) acc[m][v] = V::fma(a, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < VECS; ++v) {
      typename V::T r = acc[m][v];
      if (last && bias) r = V::add(r, V::load(bias + v * V::L));
      V::store(y + m * ldy + v * V::L, r);
    }
}

template <bool PREFETCH>
inline void group(int64_t r, const float* x, int64_t ldx, const float* w, int64_t kn,
                  const float* bias, float* y, int64_t ldy, bool first, bool last) {
  switch (r) {
    case 1: tile<1, PREFETCH>(x, ldx, w, kn, bias, y, ldy, first, last); break;
    case 2: tile<2, PREFETCH>(x, ldx, w, kn, bias, y, ldy, first, last); break;
    case 3: tile<3, PREFETCH>(x, ldx, w, kn, bias, y, ldy, first, last); break;
    case 4: tile<4, PREFETCH>(x, ldx, w, kn, bias, y, ldy, first, last); break;
    case 5: tile<5, PREFETCH>(x, ldx, w, kn, bias, y, ldy, first, last); break;
#if defined(KVH_AVX512)
    case 6: tile<6, PREFETCH>(x, ldx, w, kn, bias, y, ldy, first, last); break;
    case 7: tile<7, PREFETCH>(x, ldx, w, kn, bias, y, ldy, first, last); break;
#endif
    default: tile<GROUP, PREFETCH>(x, ldx, w, kn, bias, y, ldy, first, last);
  }
}
#endif

// y [M, N] = x [M, K] @ W^T + bias, W packed by pack(); M >= 1. Each thread takes whole
// panels; a panel is read in blocks of KBLOCK k, and every group of up to GROUP rows sums its
// share of a block before the next block streams in, so each weight byte comes from memory
// once whatever M is (up to GROUP rows, one block is the whole K).
at::Tensor few_rows(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * P;
  TORCH_CHECK(M >= 1, "cpu_gemv.few_rows takes 1 row or more, got ", M);
  TORCH_CHECK(panel() > 0, "cpu_gemv was built for neither AVX2 with FMA nor AVX-512");
  auto y = at::empty({M, N}, x.options());
#if defined(KVH_AVX2)
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t kb = M <= GROUP ? K : KBLOCK;
  at::parallel_for(0, N / P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* w = wp + p * K * P;
      const float* b = bp ? bp + p * P : nullptr;
      for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t kn = std::min(kb, K - k0);
        const bool first = k0 == 0, last = k0 + kn == K;
        for (int64_t m0 = 0; m0 < M; m0 += GROUP) {
          const int64_t r = std::min(GROUP, M - m0);
          const float* xs = xp + m0 * K + k0;
          float* ys = yp + m0 * N + p * P;
          if (m0 == 0) group<true>(r, xs, K, w + k0 * P, kn, b, ys, N, first, last);
          else group<false>(r, xs, K, w + k0 * P, kn, b, ys, N, first, last);
        }
      }
    }
  });
#endif
  return y;
}
"""

_EXT = InlineExtension("kvharbor_cpu_gemv", _SOURCE, ["panel", "pack", "few_rows"], "KVH_CPU_GEMV")


def available() -> bool:
    """True when the kernel is built for AVX2 with FMA or for AVX-512 (building it now if
    needed); ``KVH_CPU_GEMV=0`` disables it."""
    return _EXT.available() and _EXT.module.panel() > 0


def panel() -> int:
    """Outputs per packed panel of the kernel as built (2 vectors: 32 with AVX-512, 16 with
    AVX2); 0 where it is not :func:`available`."""
    return _EXT.module.panel() if available() else 0


def usable(weight: torch.Tensor) -> bool:
    """True when ``weight`` ``[N, K]`` can be packed for :func:`few_rows`: float32 on the CPU,
    ``N`` a multiple of :func:`panel`, and the kernel built."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and available() and weight.shape[0] % panel() == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as panels ``[N / P, K, P]``, ``P`` = :func:`panel` (a copy; see
    :func:`usable`)."""
    return _EXT.module.pack(weight.contiguous())


def few_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]`` (M >= 1, float32, contiguous) and ``packed`` =
    :func:`pack` (``W``)."""
    return _EXT.module.few_rows(x.contiguous(), packed, bias)
