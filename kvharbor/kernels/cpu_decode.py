"""A C++ paged decode kernel for the CPU: reads K/V in place from the paged cache.

The SDPA path (:mod:`kvharbor.kernels.cpu_attention`) first copies every key and value a
decode group needs out of the cache, then SDPA reads the copy: three passes over the K/V
bytes. This kernel makes one: per (sequence, KV head) it walks the sequence's blocks through
the block table, scores the ``G`` query heads of that KV head against each key, and keeps an
online softmax (running max and sum, rescaled once per block) over the values. float32
caches only; it is built with the system C++ compiler on first use (``torch.utils.
cpp_extension``, cached under ``~/.cache/torch_extensions``) and :func:`available` is False
when that fails, so the SDPA path stays the fallback.

Same math as the reference up to float rounding (another summation order), bounded by the
kernel tests.
"""

from __future__ import annotations

import os
import threading

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// q [B, H, D]; caches [N, bs, Hkv, D]; tables [B, W] int64; starts/lens [B] int64:
// sequence b attends to key positions [starts[b], lens[b]).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc,
                           torch::Tensor tables, torch::Tensor starts, torch::Tensor lens,
                           double scale) {
  for (const auto& t : {q, kc, vc})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous(),
                "paged_decode: q and the caches must be contiguous float32 CPU tensors");
  for (const auto& t : {tables, starts, lens})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kLong && t.is_contiguous(),
                "paged_decode: tables, starts and lens must be contiguous int64 CPU tensors");
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && kc.sizes() == vc.sizes() && q.size(2) == kc.size(3)
              && q.size(1) % kc.size(2) == 0 && tables.size(0) == q.size(0),
              "paged_decode: shapes do not match (q [B, H, D], caches [N, bs, Hkv, D], tables [B, W])");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), Hkv = kc.size(2), W = tables.size(1), G = H / Hkv;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), m(G), l(G), s(G * bs);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const float* qb = qp + (b * H + h * G) * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      int64_t pos = sp[b];
      const int64_t len = lp[b];
      while (pos < len) {
        const int64_t blk = tp[b * W + pos / bs];
        const int64_t off = pos % bs;
        const int64_t n = std::min(bs - off, len - pos);
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
            s[g * bs + j] = dot * sc;
            mx = std::max(mx, dot * sc);
          }
          const float c = std::exp(m[g] - mx);
          float* a = acc.data() + g * D;
          float sum = l[g] * c;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= c;
          for (int64_t j = 0; j < n; ++j) {
            const float p = std::exp(s[g * bs + j] - mx);
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
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * H + h * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
  return out;
}
"""

_lock = threading.Lock()
_module = None
_failed: str | None = None


def _build():
    global _module, _failed
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        try:
            from torch.utils.cpp_extension import load_inline  # noqa: PLC0415

            _module = load_inline("kvharbor_cpu_decode", cpp_sources=_SOURCE, functions=["paged_decode"],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
        except Exception as e:  # noqa: BLE001 - no compiler, headers or ninja: keep SDPA
            _failed = f"{type(e).__name__}: {e}"
        return _module


def available() -> bool:
    """True when the kernel is built (building it now if needed); ``KVH_CPU_DECODE=0`` disables."""
    if os.environ.get("KVH_CPU_DECODE", "1") == "0":
        return False
    return _build() is not None


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[B, H, D]`` float32 contiguous; caches ``[N, bs, Hkv, D]`` float32 contiguous;
    ``tables`` ``[B, W]``, ``starts``/``lens`` ``[B]`` int64 (keys ``[starts, lens)``).
    Returns ``[B, H, D]``."""
    return _module.paged_decode(q, key_cache, value_cache, tables, starts, lens, scale)
