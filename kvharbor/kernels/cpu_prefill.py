"""A C++ causal prefill attention kernel for the CPU, on the BLAS.

PyTorch's CPU flash attention (``F.scaled_dot_product_attention`` with ``is_causal``) tiles a
long prompt in 256-query by 512-key blocks and skips only whole blocks above the diagonal, so
a 1,024-token prompt computes about 1.5x the causal scores; its score and value products ran at
~85 GFLOP/s on this project's 2-core EPYC VM, where the packed linears reach ~195. This kernel
cuts each KV head's queries into blocks of ``BQ`` tokens, stacks the rows of the query heads
sharing that KV head into one matrix, and walks the keys in chunks of ``BK`` up to the block's
last visible key: the scores of a chunk are one ``sgemm`` (``Q K^T``), an online softmax (running max and sum per row, a vector
``exp`` with AVX2, 16 lanes with AVX-512 where the compiler targets it: 5-7% less time for
the whole kernel on this project's EPYC VM, 1,024 tokens, 9/3 and 8/2 heads) masks the keys
past each row's causal limit, and the values are one more
``sgemm`` accumulated into the block's output. Blocks are spread over torch's intra-op threads
in equal shares of the score work (the last blocks see the most keys).

Where the compiler targets AVX-512 and the head dim is a multiple of 16, the two products are
register tiles of our own instead of ``sgemm`` (6 rows by 64 columns in 24 vector
accumulators; the keys transposed once per call): torch's MKL takes a generic path on AMD
and ran at ~145 GFLOP/s there, oneDNN's AVX-512 products at ~210. Each 6-row group also
stops at the last key its rows see. Whole kernel, 1,024 tokens, this project's EPYC VM:
13-22% less time (9/3 heads d64 7.3 vs 8.5 ms; 8/2 d32 3.7 vs 4.3; 14/2 d64 12.3 vs 15.7).
That path walks the keys in 64-key panels, each transposed into one contiguous block, and
runs a 6-row group's scores, softmax (on the scores still in registers) and values back to
back, so a group's probabilities never leave L1. On the Intel Xeon VM (AVX-512), against the
256-key chunks whose scores went through L2 between the three passes, the variants
alternating in one process: 1,024 tokens 9/3 heads d64 4.65 vs 5.15 ms, 14/2 6.96 vs 7.58,
8/2 d32 2.45 vs 2.85; 2,048 tokens 9/3 17.3 vs 20.0 ms (9-14% less time; ~260-280 GFLOP/s of
causal work, where the two products alone run at ~370).

Queries see keys ``[0, past + i]`` (query ``i``; bottom-right causal): ``past = 0`` for a fresh
prompt attending to its own K/V, ``past`` = the cached prefix length for a prompt whose prefix
is in the cache (its keys gathered first). No sliding window: that stays on SDPA. float32 only.
Same math as the reference up to float rounding (another summation order), bounded by the
kernel tests; the engine's greedy-exact tests compare the tokens. Built with the system C++
compiler on first use (``torch.utils.cpp_extension``); :func:`available` is False when that
fails and the SDPA path stays. ``KVH_CPU_PREFILL=0`` disables it (for A/B runs).
"""

from __future__ import annotations

import torch

from .inline_cpp import InlineExtension

_SOURCE = r"""
@ATEN_HEADERS@
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>
@SIMD_MATH@
// The Fortran BLAS sgemm that torch's CPU build exports (MKL on x86).
extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b,
                       const int* ldb, const float* beta, float* c, const int* ldc);

namespace {

// Column-major C [m, n] = alpha op(A) op(B) + beta C.
inline void gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int mi = m, ni = n, ki = k, la = lda, lb = ldb, lc = ldc;
  sgemm_(&ta, &tb, &mi, &ni, &ki, &alpha, a, &la, b, &lb, &beta, c, &lc);
}

constexpr int64_t BQ = 64;    // query tokens per block
constexpr int64_t BK = 256;   // keys per score chunk

// Row max of s[0, n).
inline float row_max(const float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#ifdef KVH_AVX512
  mx = max_run<V16>(s, j, n, mx);
#endif
#ifdef KVH_AVX2
  mx = max_run<V8>(s, j, n, mx);
#endif
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// s[0, n) = exp(s - mx), s[n, w) = 0; returns the sum of s[0, n).
inline float exp_row(float* s, int64_t n, int64_t w, float mx) {
  float sum = 0.f;
  int64_t j = 0;
#ifdef KVH_AVX512
  sum += exp_run<V16>(s, j, n, mx);
#endif
#ifdef KVH_AVX2
  sum += exp_run<V8>(s, j, n, mx);
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  std::fill(s + n, s + w, 0.f);
  return sum;
}

// One row's online-softmax step over a key chunk: s[0, n) = exp(s - running max), s[n, w) = 0,
// the running max m and sum l updated, the row's output o [D] zeroed on the first chunk and
// rescaled to the new max after it. n <= 0: the whole chunk is past the row's last key.
inline void softmax_row(float* s, int64_t n, int64_t w, bool first, float& m, float& l, float* o,
                        int64_t D) {
  if (n <= 0) {
    std::fill(s, s + w, 0.f);
    return;
  }
  const float mx = std::max(m, row_max(s, n));
  const float c = first ? 0.f : std::exp(m - mx);
  l = l * c + exp_row(s, n, w, mx);
  m = mx;
  if (first) {
    std::fill(o, o + D, 0.f);
  } else if (c != 1.f) {
    for (int64_t d = 0; d < D; ++d) o[d] *= c;
  }
}

// out rows [q0, q0 + M) of the G heads = O / l: O's rows stacked head-major (row g * M + r is
// head g's query q0 + r), l each row's softmax sum.
inline void write_rows(const float* O, const float* l, float* out, int64_t so, int64_t q0,
                       int64_t M, int64_t G, int64_t D) {
  for (int64_t i = 0; i < G * M; ++i) {
    const float inv = 1.f / l[i];
    float* dst = out + (q0 + i % M) * so + i / M * D;
    const float* o = O + i * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = o[d] * inv;
  }
}

// Query block [q0, q1) of the G query heads that share one KV head: their rows stacked
// (head-major) in one matrix, so each key chunk is one product for all of them. q, out point
// at the first of the G heads; sq/sk/sv/so: token strides (floats).
void block(const float* q, const float* k, const float* v, float* out, int64_t sq, int64_t sk,
           int64_t sv, int64_t so, int64_t q0, int64_t q1, int64_t past, int64_t G, int64_t D,
           float scale, float* Q, float* S, float* O, float* m, float* l) {
  const int64_t M = q1 - q0, R = G * M, kend = past + q1;   // keys [0, kend) reach this block
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < M; ++r)
      std::copy(q + (q0 + r) * sq + g * D, q + (q0 + r) * sq + (g + 1) * D, Q + (g * M + r) * D);
  std::fill(m, m + R, -std::numeric_limits<float>::infinity());
  std::fill(l, l + R, 0.f);
  for (int64_t c0 = 0; c0 < kend; c0 += BK) {
    const int64_t N = std::min(BK, kend - c0);
    // S [R, N] (row-major, ld N) = scale * Q [R, D] K[c0:c0+N]^T; column-major: S^T = K Q^T.
    gemm('T', 'N', N, R, D, scale, k + c0 * sk, sk, Q, D, 0.f, S, N);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t n = std::min<int64_t>(N, past + q0 + i % M + 1 - c0);   // visible keys
      softmax_row(S + i * N, n, N, c0 == 0, m[i], l[i], O + i * D, D);
    }
    // O [R, D] += P [R, N] V[c0:c0+N]; column-major: O^T += V^T P^T.
    gemm('N', 'N', D, R, N, 1.f, v + c0 * sv, sv, S, N, 1.f, O, D);
  }
  write_rows(O, l, out, so, q0, M, G, D);
}

#ifdef KVH_AVX512
// Register-tiled products on 16 lanes, used instead of sgemm_ where the compiler targets
// AVX-512 and the head dim is a multiple of 16: torch's MKL runs its sgemm at ~145 GFLOP/s on
// this project's EPYC VM (it takes a generic path on AMD), where oneDNN's AVX-512 products
// reach ~210. MR rows by NV x 16 columns of C live in registers (6 x 4 = 24 accumulators)
// while the k loop broadcasts one A element per row and loads NV vectors of B.
constexpr int64_t MR = 6;
constexpr int64_t PANEL = 64;   // keys per panel of the transposed keys (and per score tile)

// r [MR][NV] (registers) += A [MR, K] (ld lda) B [K, NV*16] (ld ldb).
template <int NV>
__attribute__((always_inline)) inline void fma_tile(__m512 (&r)[MR][NV], const float* a,
                                                    int64_t lda, const float* b, int64_t ldb,
                                                    int64_t K) {
  for (int64_t k = 0; k < K; ++k) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = _mm512_loadu_ps(b + k * ldb + j * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i * lda + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) r[i][j] = _mm512_fmadd_ps(ai, bv[j], r[i][j]);
    }
  }
}

// C [MR, NV*16] (ld ldc) += A [MR, K] (ld lda) B [K, NV*16] (ld ldb).
template <int NV>
inline void tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float* c,
                 int64_t ldc) {
  __m512 r[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) r[i][j] = _mm512_loadu_ps(c + i * ldc + j * 16);
  fma_tile<NV>(r, a, lda, b, ldb, K);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(c + i * ldc + j * 16, r[i][j]);
}

// tile<nv> for nv in [1, 4] (C's columns: nv x 16).
inline void tile_n(int nv, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K,
                   float* c, int64_t ldc) {
  switch (nv) {
    case 4: tile<4>(a, lda, b, ldb, K, c, ldc); break;
    case 3: tile<3>(a, lda, b, ldb, K, c, ldc); break;
    case 2: tile<2>(a, lda, b, ldb, K, c, ldc); break;
    default: tile<1>(a, lda, b, ldb, K, c, ldc); break;
  }
}

// The keys k[0:n] of one KV head (token stride sk) transposed into panels of PANEL keys:
// kt [width / PANEL][D][PANEL], width a multiple of PANEL, keys [n, width) zero. A panel is
// one contiguous 16 KiB (D = 64) that stays in L1 while every row group of a query block
// reads it (rows of a single [D, keys] matrix sit a power of two apart at 1,024 or 2,048
// keys and evicted each other from L1's sets: 5-10% of the kernel's time).
void pack_keys(const float* k, int64_t sk, int64_t n, int64_t width, int64_t D, float* kt) {
  for (int64_t j0 = 0; j0 < width; j0 += 16) {
    const int64_t w = std::min<int64_t>(16, std::max<int64_t>(0, n - j0));
    for (int64_t d = 0; d < D; ++d) {
      float* dst = kt + j0 / PANEL * D * PANEL + d * PANEL + j0 % PANEL;
      for (int64_t jj = 0; jj < w; ++jj) dst[jj] = k[(j0 + jj) * sk + d];
      std::fill(dst + w, dst + 16, 0.f);
    }
  }
}

// The scores of MR query rows a [MR, K] (ld lda) against NV x 16 keys of one panel b
// [K][PANEL], kept in registers for each row's online-softmax step: s [MR, NV*16] (ld lds) =
// exp(score - the row's new running max) over its vis[i] visible keys, zero past them (and
// for a row that sees none); the running max m and sum l updated, and the row's output o
// (ld D) rescaled to the new max. The scores never go through memory before their exp.
template <int NV>
inline void qk_softmax(const float* a, int64_t lda, const float* b, int64_t K, float* s,
                       int64_t lds, const int64_t* vis, float* m, float* l, float* o, int64_t D) {
  __m512 r[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) r[i][j] = _mm512_setzero_ps();
  fma_tile<NV>(r, a, lda, b, PANEL, K);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const int64_t n = vis[i];
    float* si = s + i * lds;
    if (n <= 0) {
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(si + j * 16, _mm512_setzero_ps());
      continue;
    }
    __mmask16 mk[NV];
    __m512 mxv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const int64_t c = std::min<int64_t>(16, std::max<int64_t>(0, n - j * 16));
      mk[j] = static_cast<__mmask16>((1u << c) - 1);
      mxv = _mm512_mask_max_ps(mxv, mk[j], mxv, r[i][j]);
    }
    const float mx = std::max(m[i], _mm512_reduce_max_ps(mxv));
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __m512 p = _mm512_maskz_mov_ps(mk[j], exp_nonpos<V16>(_mm512_sub_ps(r[i][j], mv)));
      _mm512_storeu_ps(si + j * 16, p);
      sum = _mm512_add_ps(sum, p);
    }
    if (m[i] != -std::numeric_limits<float>::infinity() && m[i] != mx) {
      const float c = std::exp(m[i] - mx);
      l[i] *= c;
      float* oi = o + i * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(oi + d, _mm512_mul_ps(_mm512_loadu_ps(oi + d), _mm512_set1_ps(c)));
    }
    l[i] += _mm512_reduce_add_ps(sum);
    m[i] = mx;
  }
}

// qk_softmax<nv> for nv in [1, 4].
inline void qk_softmax_n(int nv, const float* a, int64_t lda, const float* b, int64_t K,
                         float* s, int64_t lds, const int64_t* vis, float* m, float* l,
                         float* o, int64_t D) {
  switch (nv) {
    case 4: qk_softmax<4>(a, lda, b, K, s, lds, vis, m, l, o, D); break;
    case 3: qk_softmax<3>(a, lda, b, K, s, lds, vis, m, l, o, D); break;
    case 2: qk_softmax<2>(a, lda, b, K, s, lds, vis, m, l, o, D); break;
    default: qk_softmax<1>(a, lda, b, K, s, lds, vis, m, l, o, D); break;
  }
}

// block() with the tiles above: kt is this KV head's keys in panels (see pack_keys); Q, O,
// m and l hold the rows rounded up to MR (the extra rows are zero queries whose results are
// never written out); S one group's probabilities. The keys are walked a panel at a time and,
// within a panel, the rows MR at a time: a group's scores, softmax and values run back to back
// on its probabilities in L1 (before, all rows' scores of a 256-key chunk went through L2
// between the three), the panel's keys and values are shared by all groups, and each group
// stops at the last 16 keys one of its rows sees.
void block16(const float* q, const float* kt, const float* v, float* out, int64_t sq,
             int64_t sv, int64_t so, int64_t q0, int64_t q1, int64_t past, int64_t G, int64_t D,
             float scale, float* Q, float* S, float* O, float* m, float* l) {
  const int64_t M = q1 - q0, R = G * M, Rp = (R + MR - 1) / MR * MR, kend = past + q1;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < M; ++r) {
      const float* src = q + (q0 + r) * sq + g * D;
      float* dst = Q + (g * M + r) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
    }
  std::fill(Q + R * D, Q + Rp * D, 0.f);
  std::fill(O, O + Rp * D, 0.f);
  std::fill(m, m + Rp, -std::numeric_limits<float>::infinity());
  std::fill(l, l + Rp, 0.f);
  const int64_t groups = Rp / MR;
  int64_t vis[MR];
  for (int64_t c0 = 0; c0 < kend; c0 += PANEL) {
    const int64_t N = std::min(PANEL, kend - c0);
    for (int64_t gi = 0; gi < groups; ++gi) {
      int64_t n = 0;
      for (int64_t i = 0; i < MR; ++i) {
        const int64_t row = gi * MR + i;
        vis[i] = row < R ? std::min<int64_t>(N, past + q0 + row % M + 1 - c0) : 0;
        n = std::max(n, vis[i]);
      }
      if (n <= 0) continue;
      const int nv = static_cast<int>((n + 15) / 16);
      qk_softmax_n(nv, Q + gi * MR * D, D, kt + c0 * D, D, S, PANEL, vis, m + gi * MR,
                   l + gi * MR, O + gi * MR * D, D);
      // O [MR, D] += P [MR, n] V[c0:c0+n], 64 dims at a time.
      for (int64_t d0 = 0; d0 < D; d0 += 64)
        tile_n(static_cast<int>(std::min<int64_t>(4, (D - d0) / 16)), S, PANEL, v + c0 * sv + d0,
               sv, n, O + gi * MR * D + d0, D);
    }
  }
  write_rows(O, l, out, so, q0, M, G, D);
}
#endif

}  // namespace

// q [T, H, D], k/v [past + T, Hkv, D] (any token stride, heads and dims contiguous); query i
// sees keys [0, past + i]. out [T, H, D] (any token stride, heads and dims contiguous).
void causal_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor out,
                      int64_t past, double scale) {
  for (const auto& t : {q, k, v, out})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 3
                && t.stride(2) == 1 && t.stride(1) == t.size(2),
                "causal_attention: float32 CPU [tokens, heads, head_dim] tensors with contiguous heads");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(past >= 0 && k.sizes() == v.sizes() && k.size(0) >= past + T && k.size(2) == D
              && H % Hkv == 0 && out.sizes() == q.sizes(),
              "causal_attention: shapes do not match (q [T, H, D], k/v [>= past + T, Hkv, D])");
  const int64_t G = H / Hkv, nb = (T + BQ - 1) / BQ, U = Hkv * nb;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0), so = out.stride(0);
  const float sc = static_cast<float>(scale);
  // Units (KV head, query block), each thread a contiguous run holding ~1/nt of the score
  // work (a block's work grows with its last key).
  std::vector<int64_t> cum(U + 1, 0);
  for (int64_t u = 0; u < U; ++u) cum[u + 1] = cum[u] + past + std::min(T, (u % nb + 1) * BQ);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), U));
  std::vector<int64_t> cut(nt + 1, U);
  cut[0] = 0;
  for (int64_t t = 1; t < nt; ++t)
    cut[t] = std::lower_bound(cum.begin(), cum.end(), cum[U] * t / nt) - cum.begin();
#ifdef KVH_AVX512
  // Keys transposed once per call into panels (all KV heads), at most 64 MiB of them.
  const int64_t L = past + T, ldk = (L + PANEL - 1) / PANEL * PANEL;
  if (D % 16 == 0 && Hkv * D * ldk <= (int64_t{16} << 20)) {
    // Every element is written by pack_keys (padding included): no zero-fill first.
    std::unique_ptr<float[]> kt(new float[Hkv * D * ldk]);
    const int64_t pieces = (ldk + 255) / 256;
    at::parallel_for(0, Hkv * pieces, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t hk = u / pieces, j0 = u % pieces * 256;
        const int64_t w = std::min<int64_t>(256, ldk - j0);
        pack_keys(kp + hk * D + j0 * sk, sk, std::min(w, L - j0), w, D,
                  kt.get() + hk * D * ldk + j0 * D);
      }
    });
    const int64_t Rp = (G * BQ + MR - 1) / MR * MR;
    at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> Q(Rp * D), S(MR * PANEL), O(Rp * D), m(Rp), l(Rp);
      for (int64_t u = cut[begin]; u < cut[end]; ++u) {
        const int64_t hk = u / nb, b = u % nb;
        block16(qp + hk * G * D, kt.get() + hk * D * ldk, vp + hk * D, op + hk * G * D, sq, sv,
                so, b * BQ, std::min(T, (b + 1) * BQ), past, G, D, sc, Q.data(), S.data(),
                O.data(), m.data(), l.data());
      }
    });
    return;
  }
#endif
  at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Q(G * BQ * D), S(G * BQ * BK), O(G * BQ * D), m(G * BQ), l(G * BQ);
    for (int64_t u = cut[begin]; u < cut[end]; ++u) {
      const int64_t hk = u / nb, b = u % nb;
      block(qp + hk * G * D, kp + hk * D, vp + hk * D, op + hk * G * D, sq, sk, sv, so, b * BQ,
            std::min(T, (b + 1) * BQ), past, G, D, sc, Q.data(), S.data(), O.data(), m.data(),
            l.data());
    }
  });
}
"""

_EXT = InlineExtension("kvharbor_cpu_prefill", _SOURCE, ["causal_attention"], "KVH_CPU_PREFILL")


def available() -> bool:
    """True when the kernel is built (building it now if needed); ``KVH_CPU_PREFILL=0`` disables."""
    return _EXT.available()


def usable(*tensors: torch.Tensor) -> bool:
    """True when the kernel takes these tensors: float32 on the CPU, ``[tokens, heads, dim]``
    with heads and dims contiguous (any token stride), and the kernel is built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3
               and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in tensors) and available()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     past: int, scale: float) -> None:
    """``out[i] = softmax(scale * q[i] k[:past + i + 1]^T) v[:past + i + 1]`` for every query
    head (GQA: head ``h`` reads KV head ``h // (H // Hkv)``), written in place.

    Args:
        q: ``[T, H, D]``; k, v: ``[>= past + T, Hkv, D]``; out: ``[T, H, D]``, all float32 CPU
            with heads and dims contiguous (any token stride; see :func:`usable`).
        past: keys before the first query's own position (0 for a fresh prompt).
    """
    _EXT.module.causal_attention(q, k, v, out, past, scale)
