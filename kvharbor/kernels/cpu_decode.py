"""A C++ paged decode kernel for the CPU: reads K/V in place from the paged cache.

The SDPA path (:mod:`kvharbor.kernels.cpu_attention`) first copies every key and value a
decode group needs out of the cache, then SDPA reads the copy: three passes over the K/V
bytes. This kernel makes one: per sequence it walks the blocks through the block table
(prefetching the next block into L2 while it works on this one), scores the ``G`` query heads
of each KV head against the block's keys, and keeps an online softmax (running max and sum,
rescaled once per block) over the values. With AVX2 and FMA (head_dim 16, 32, 64 or 128) it
scores 8 keys at once, takes their exp with a vector polynomial (relative error < 1e-7) and
keeps the outputs in registers; other shapes and CPUs take a plain loop. The batch is split
over torch's intra-op threads in runs of sequences holding equal shares of the keys (by KV
head when there are fewer than two sequences per thread). float32 caches
only; it is built with the system C++ compiler on first use (``torch.utils.cpp_extension``,
cached under ``~/.cache/torch_extensions``) and :func:`available` is False when that fails,
so the SDPA path stays the fallback.

Same math as the reference up to float rounding (another summation order), bounded by the
kernel tests.
"""

from __future__ import annotations

import torch

from .inline_cpp import InlineExtension

_SOURCE = r"""
@ATEN_HEADERS@
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
@SIMD_MATH@
namespace {

// One (sequence, KV head): the G query heads that share it, over keys [pos, len).
void decode_scalar(const float* qb, const float* kp, const float* vp, const int64_t* table,
                   int64_t pos, int64_t len, int64_t bs, int64_t Hkv, int64_t h, int64_t G,
                   int64_t D, float sc, float* out, float* acc, float* m, float* l, float* s) {
  std::fill(acc, acc + G * D, 0.f);
  std::fill(m, m + G, -std::numeric_limits<float>::infinity());
  std::fill(l, l + G, 0.f);
  while (pos < len) {
    const int64_t blk = table[pos / bs], off = pos % bs, n = std::min(bs - off, len - pos);
    const float* kb = kp + ((blk * bs + off) * Hkv + h) * D;
    const float* vb = vp + ((blk * bs + off) * Hkv + h) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qb + g * D;
      float mx = m[g];
      for (int64_t j = 0; j < n; ++j) {
        const float* k = kb + j * Hkv * D;
        float dot = 0.f;
#pragma omp simd reduction(+:dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
        s[j] = dot * sc;
        mx = std::max(mx, s[j]);
      }
      const float c = std::exp(m[g] - mx);
      float* a = acc + g * D;
      float sum = l[g] * c;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= c;
      for (int64_t j = 0; j < n; ++j) {
        const float p = std::exp(s[j] - mx);
        sum += p;
        const float* v = vb + j * Hkv * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
      }
      m[g] = mx;
      l[g] = sum;
    }
    pos += n;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] / l[g];
}

#ifdef KVH_AVX2
// The 8 sums of a[0..8), one per lane.
inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// All-ones in lanes [0, cnt), zeros above.
inline __m256 lanes_below(int64_t cnt) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cnt)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// One sequence, all its heads, block by block (each K and V block is read once, whole, and
// the next one is prefetched while this one is scored). DC = head_dim / 8. Per block and
// query head: 8 keys scored at once (8 dot products reduced together), one vector exp per
// 8 keys, the output accumulated in registers.
template <int DC>
void decode_avx2(const float* qseq, const float* kp, const float* vp, const int64_t* table,
                 int64_t pos, int64_t len, int64_t bs, int64_t Hkv, int64_t h0, int64_t h1,
                 int64_t G, float sc, float* oseq, float* acc, float* m, float* l, float* s) {
  constexpr int64_t D = DC * 8;
  const int64_t stride = Hkv * D;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t H = Hkv * G;
  std::fill(acc, acc + H * D, 0.f);
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.f);
  while (pos < len) {
    const int64_t blk = table[pos / bs], off = pos % bs, n = std::min(bs - off, len - pos);
    const int64_t n8 = (n + 7) / 8;
    const char* nk = nullptr;
    const char* nv = nullptr;
    int64_t nn = 0;
    // The next block is elsewhere in memory: ask for its rows of heads [h0, h1) into L2, a
    // share of its tokens per query head, so the requests spread over this block's work (one
    // burst at the start, or into L1, was 1.5-2x slower on a 2-core EPYC VM with the cache in
    // DRAM).
    if (pos + n < len) {
      const int64_t nblk = table[(pos + n) / bs];
      nk = reinterpret_cast<const char*>(kp + (nblk * bs * Hkv + h0) * D);
      nv = reinterpret_cast<const char*>(vp + (nblk * bs * Hkv + h0) * D);
      nn = std::min(bs, len - pos - n);
    }
    const int64_t Hs = (h1 - h0) * G, slice = (h1 - h0) * D * 4;
    for (int64_t h = h0; h < h1; ++h) {
      const float* kb = kp + ((blk * bs + off) * Hkv + h) * D;
      const float* vb = vp + ((blk * bs + off) * Hkv + h) * D;
      const float* qb = qseq + h * G * D;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hg = h * G + g;
        const int64_t idx = hg - h0 * G;
        for (int64_t j = nn * idx / Hs; j < nn * (idx + 1) / Hs; ++j)
          for (int64_t bt = 0; bt < slice; bt += 64) {
            _mm_prefetch(nk + j * stride * 4 + bt, _MM_HINT_T1);
            _mm_prefetch(nv + j * stride * 4 + bt, _MM_HINT_T1);
          }
        const float* qg = qb + g * D;
        __m256 vmax = neg_inf;
        for (int64_t j8 = 0; j8 < n8; ++j8) {
          const int64_t cnt = std::min<int64_t>(8, n - j8 * 8);
          const float* k0 = kb + j8 * 8 * stride;
          __m256 dots[8];
          for (int jj = 0; jj < 8; ++jj) dots[jj] = _mm256_setzero_ps();
          // Slabs of at most 4 chunks keep the query slab and the 8 sums in registers.
          for (int c0 = 0; c0 < DC; c0 += 4) {
            constexpr int SW = DC < 4 ? DC : 4;
            __m256 q[SW];
            for (int c = 0; c < SW; ++c) q[c] = _mm256_loadu_ps(qg + (c0 + c) * 8);
            for (int jj = 0; jj < 8; ++jj) {
              if (jj < cnt) {
                const float* k = k0 + jj * stride + c0 * 8;
                for (int c = 0; c < SW; ++c) dots[jj] = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(k + c * 8), dots[jj]);
              }
            }
          }
          __m256 sv = _mm256_mul_ps(sum8(dots), _mm256_set1_ps(sc));
          sv = _mm256_blendv_ps(neg_inf, sv, lanes_below(cnt));
          _mm256_storeu_ps(s + j8 * 8, sv);
          vmax = _mm256_max_ps(vmax, sv);
        }
        const float mx = std::max(m[hg], V8::hmax(vmax));
        const float c0 = std::exp(m[hg] - mx);
        const __m256 mxv = _mm256_set1_ps(mx);
        __m256 psum = _mm256_setzero_ps();
        for (int64_t j8 = 0; j8 < n8; ++j8) {
          const __m256 p = exp_nonpos<V8>(_mm256_sub_ps(_mm256_loadu_ps(s + j8 * 8), mxv));
          const __m256 pm = _mm256_and_ps(p, lanes_below(n - j8 * 8));
          _mm256_storeu_ps(s + j8 * 8, pm);
          psum = _mm256_add_ps(psum, pm);
        }
        float* a = acc + hg * D;
        __m256 o[DC];
        const __m256 cv = _mm256_set1_ps(c0);
        for (int c = 0; c < DC; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(a + c * 8), cv);
        for (int64_t j = 0; j < n; ++j) {
          const __m256 p = _mm256_broadcast_ss(s + j);
          const float* v = vb + j * stride;
          for (int c = 0; c < DC; ++c) o[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + c * 8), o[c]);
        }
        for (int c = 0; c < DC; ++c) _mm256_storeu_ps(a + c * 8, o[c]);
        l[hg] = l[hg] * c0 + V8::hsum(psum);
        m[hg] = mx;
      }
    }
    pos += n;
  }
  for (int64_t g = h0 * G; g < h1 * G; ++g) {
    const __m256 inv = _mm256_set1_ps(1.f / l[g]);
    for (int c = 0; c < DC; ++c)
      _mm256_storeu_ps(oseq + g * D + c * 8, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + c * 8), inv));
  }
}
#endif

}  // namespace

// True when built with OpenMP: ATen's parallel_for is inlined from headers, and without
// -fopenmp its pragma is dropped and every call runs on one thread (measured: 2 threads were
// no faster than 1).
bool threaded() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

// q [B, H, D]; caches [N, bs, Hkv, D]; tables [B, W] int64; starts/lens [B] int64:
// sequence b attends to key positions [starts[b], lens[b]).
at::Tensor paged_decode(at::Tensor q, at::Tensor kc, at::Tensor vc,
                           at::Tensor tables, at::Tensor starts, at::Tensor lens,
                           double scale) {
  for (const auto& t : {q, kc, vc})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "paged_decode: q and the caches must be contiguous float32 CPU tensors");
  for (const auto& t : {tables, starts, lens})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(),
                "paged_decode: tables, starts and lens must be contiguous int64 CPU tensors");
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && kc.sizes() == vc.sizes() && q.size(2) == kc.size(3)
              && q.size(1) % kc.size(2) == 0 && tables.size(0) == q.size(0),
              "paged_decode: shapes do not match (q [B, H, D], caches [N, bs, Hkv, D], tables [B, W])");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), Hkv = kc.size(2), W = tables.size(1), G = H / Hkv;
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
#ifdef KVH_AVX2
  using VectorDecode = void (*)(const float*, const float*, const float*, const int64_t*, int64_t,
                                int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                float*, float*, float*, float*, float*);
  const VectorDecode vector_decode = D == 16 ? decode_avx2<2> : D == 32 ? decode_avx2<4>
                                   : D == 64 ? decode_avx2<8> : D == 128 ? decode_avx2<16> : nullptr;
  if (vector_decode != nullptr) {
    // Work units: whole sequences, or (sequence, KV head) when there are too few sequences
    // to keep every thread busy. Each thread takes a contiguous run of units holding about
    // 1/nt of the keys (an even split by count left one thread with the long sequences).
    const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
    const int64_t per = B >= 2 * nt ? Hkv : 1;
    const int64_t U = B * (Hkv / per);
    std::vector<int64_t> cum(U + 1, 0);
    for (int64_t u = 0; u < U; ++u) {
      const int64_t b = u / (Hkv / per);
      cum[u + 1] = cum[u] + std::max<int64_t>(lp[b] - sp[b], 0) * per + 1;
    }
    std::vector<int64_t> cut(nt + 1, U);
    cut[0] = 0;
    for (int64_t t = 1; t < nt; ++t)
      cut[t] = std::lower_bound(cum.begin(), cum.end(), cum[U] * t / nt) - cum.begin();
    at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(H * D), m(H), l(H), s(bs + 8);
      for (int64_t u = cut[begin]; u < cut[end]; ++u) {
        const int64_t b = u / (Hkv / per), h0 = u % (Hkv / per) * per;
        vector_decode(qp + b * H * D, kp, vp, tp + b * W, sp[b], lp[b], bs, Hkv, h0, h0 + per, G,
                      sc, op + b * H * D, acc.data(), m.data(), l.data(), s.data());
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), m(G), l(G), s(bs + 8);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const float* qb = qp + (b * H + h * G) * D;
      decode_scalar(qb, kp, vp, tp + b * W, sp[b], lp[b], bs, Hkv, h, G, D, sc,
                    op + (b * H + h * G) * D, acc.data(), m.data(), l.data(), s.data());
    }
  });
  return out;
}
"""

_EXT = InlineExtension("kvharbor_cpu_decode", _SOURCE, ["paged_decode", "threaded"], "KVH_CPU_DECODE")


def available() -> bool:
    """True when the kernel is built (building it now if needed); ``KVH_CPU_DECODE=0`` disables."""
    return _EXT.available()


def threaded() -> bool:
    """True when the built kernel splits its work over torch's intra-op threads."""
    return bool(_EXT.module.threaded())


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[B, H, D]`` float32 contiguous; caches ``[N, bs, Hkv, D]`` float32 contiguous;
    ``tables`` ``[B, W]``, ``starts``/``lens`` ``[B]`` int64 (keys ``[starts, lens)``).
    Returns ``[B, H, D]``."""
    return _EXT.module.paged_decode(q, key_cache, value_cache, tables, starts, lens, scale)
