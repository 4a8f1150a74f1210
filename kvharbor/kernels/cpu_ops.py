"""Fused C++ forms of the small per-layer ops of a Llama-family forward on the CPU (float32).

Each decoder layer runs two RMSNorms, two residual adds and the rotary embedding of q and k.
transformers writes them as 5-12 tensor ops each (``pow``, ``mean``, ``rsqrt``, ``mul``,
``cat``, ``neg``...): at decode batch sizes every op costs its dispatch more than its math,
and at prefill sizes every op is another pass over ``[T, hidden]``. Here each is one pass:

- :func:`rms_norm`: ``w * (x * rsqrt(mean(x^2) + eps))``, transformers' ``LlamaRMSNorm``.
- :func:`add_rms_norm`: ``residual += x`` in place, then the norm of the new ``residual``.
- :func:`rotary_`: ``x * cos + rotate_half(x) * sin`` in place on a ``[T, H, D]`` view (the
  q or k columns of the packed qkv product, any row and head strides).
- :func:`silu_mul`: ``silu(gate) * up`` from one ``[T, 2 * inter]`` gate/up product, read row
  by row (torch's ``silu`` on the strided half of such a product was 3x slower than on a
  contiguous one, so the MLP ran two products and two passes, ``silu_`` then ``mul_``).

Built with ``-ffp-contract=off``, so every product and sum rounds as torch's elementwise ops
do: the residual add and the rotary embedding are bit-identical to transformers; the norm's
sum of squares is taken in another order (float rounding, ~1e-7 relative), like the packed
linears, and SiLU's ``exp`` is a polynomial of our own (``inline_cpp.SIMD_MATH``, relative error
< 1e-7 against torch's). Built with the system C++ compiler on first use (``torch.utils.cpp_extension``, cached
under ``~/.cache/torch_extensions``); :func:`available` is False when that fails, and the
model path then calls the transformers modules.
"""

from __future__ import annotations

import torch

from .inline_cpp import InlineExtension

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
@SIMD_MATH@
namespace {

// Rows per parallel task: about 16k floats, so decode-sized calls stay on one thread.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+:ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2
              && x.is_contiguous(), "cpu_ops: x must be a contiguous [rows, hidden] float32 CPU tensor");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat && w.is_contiguous()
              && w.dim() == 1 && w.size(0) == x.size(1), "cpu_ops: weight must be float32 [hidden]");
}

// x * sigmoid(x) * u over whole vectors of [j, n), advancing j: sigmoid from e = exp(-|x|)
// (never overflows) as 1 / (1 + e) for x >= 0 and e / (1 + e) below.
#ifdef KVH_AVX512
inline void silu_mul_run16(const float* g, const float* u, float* h, int64_t& j, int64_t n) {
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_loadu_ps(g + j);
    const __m512 e = exp_nonpos<V16>(_mm512_min_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), x)));
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 s = _mm512_div_ps(_mm512_mask_mul_ps(x, neg, x, e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm512_storeu_ps(h + j, _mm512_mul_ps(s, _mm512_loadu_ps(u + j)));
  }
}
#endif
#ifdef KVH_AVX2
inline void silu_mul_run8(const float* g, const float* u, float* h, int64_t& j, int64_t n) {
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(g + j);
    const __m256 e = exp_nonpos<V8>(_mm256_min_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), x)));
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), neg);
    const __m256 s = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    _mm256_storeu_ps(h + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
  }
}
#endif

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, w);
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * n, wp, op + r * n, n, e);
  });
  return out;
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_rows(x, w);
  check_rows(residual, w);
  TORCH_CHECK(residual.sizes() == x.sizes(), "cpu_ops: x and residual differ in shape");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = rp + r * n;
      const float* xr = xp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) res[i] = res[i] + xr[i];
      norm_row(res, wp, op + r * n, n, e);
    }
  });
  return out;
}

// gu [T, 2 * I] contiguous (gate columns, then up); returns silu(gate) * up [T, I].
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.device().is_cpu() && gu.scalar_type() == torch::kFloat && gu.dim() == 2
              && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "cpu_ops.silu_mul: gu must be a contiguous float32 [rows, 2 * inter] CPU tensor");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * 2 * I;
      const float* u = g + I;
      float* h = op + r * I;
      int64_t j = 0;
#ifdef KVH_AVX512
      silu_mul_run16(g, u, h, j, I);
#endif
#ifdef KVH_AVX2
      silu_mul_run8(g, u, h, j, I);
#endif
      for (; j < I; ++j) h[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
    }
  });
  return out;
}

// t [T, H, D] (last dim contiguous), cos/sin [T, D] contiguous; in place.
void rotary_(torch::Tensor t, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.dim() == 3
              && t.stride(2) == 1 && t.size(2) % 2 == 0,
              "cpu_ops.rotary_: t must be a float32 [T, H, D] CPU view with contiguous, even D");
  for (const auto& c : {cos, sin})
    TORCH_CHECK(c.device().is_cpu() && c.scalar_type() == torch::kFloat && c.is_contiguous()
                && c.dim() == 2 && c.size(0) == t.size(0) && c.size(1) == t.size(2),
                "cpu_ops.rotary_: cos and sin must be contiguous float32 [T, D]");
  const int64_t T = t.size(0), H = t.size(1), D = t.size(2), half = D / 2;
  const int64_t st = t.stride(0), sh = t.stride(1);
  float* tp = t.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * D;
      const float* s = sp + r * D;
      for (int64_t h = 0; h < H; ++h) {
        float* x = tp + r * st + h * sh;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] + (-x2) * s[i];
          x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}
"""

_EXT = InlineExtension("kvharbor_cpu_ops", _SOURCE, ["rms_norm", "add_rms_norm", "rotary_", "silu_mul"], "KVH_CPU_OPS",
                      extra_cflags=("-ffp-contract=off",))


def available() -> bool:
    """True when the ops are built (building them now if needed); ``KVH_CPU_OPS=0`` disables."""
    return _EXT.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` of ``x`` ``[rows, hidden]`` (a new tensor)."""
    return _EXT.module.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (in place), then :func:`rms_norm` of ``residual``."""
    return _EXT.module.add_rms_norm(x, residual, weight, eps)


def rotary_(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``t = t * cos + rotate_half(t) * sin`` in place; ``t`` ``[T, H, D]`` (any row and head
    strides), ``cos``/``sin`` ``[T, D]``. Returns ``t``."""
    _EXT.module.rotary_(t, cos, sin)
    return t


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` ``[rows, inter]`` of a contiguous ``[rows, 2 * inter]`` product whose
    first half is the gate's and second the up projection's (a new tensor)."""
    return _EXT.module.silu_mul(gate_up)
