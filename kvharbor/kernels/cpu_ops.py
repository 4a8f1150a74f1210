"""Fused C++ forms of the small per-layer ops of a Llama-family forward on the CPU (float32).

Each decoder layer runs two RMSNorms, two residual adds and the rotary embedding of q and k.
transformers writes them as 5-12 tensor ops each (``pow``, ``mean``, ``rsqrt``, ``mul``,
``cat``, ``neg``...): at decode batch sizes every op costs its dispatch more than its math,
and at prefill sizes every op is another pass over ``[T, hidden]``. Here each is one pass:

- :func:`rms_norm`: ``w * (x * rsqrt(mean(x^2) + eps))``, transformers' ``LlamaRMSNorm``.
- :func:`add_rms_norm`: ``residual += x`` in place, then the norm of the new ``residual``.
- :func:`rotary_`: ``x * cos + rotate_half(x) * sin`` in place on a ``[T, H, D]`` view (the
  q or k columns of the packed qkv product, any row and head strides).
- :func:`store_rows`: a step's K or V rows copied to their slots of a float32 KV cache, one
  ``memcpy`` per row: torch's ``index_copy_`` took 0.13 ms per 1,024 rows of the 135M model's
  K (3 x 64 floats, strided rows; ~8 ms of a 1,024-token prefill over 30 layers).

Built with ``-ffp-contract=off``, so every product and sum rounds as torch's elementwise ops
do: the residual add and the rotary embedding are bit-identical to transformers; the norm's
sum of squares is taken in another order (float rounding, ~1e-7 relative), like the packed
linears. Built with the system C++ compiler on first use (``torch.utils.cpp_extension``, cached
under ``~/.cache/torch_extensions``); :func:`available` is False when that fails, and the
model path then calls the transformers modules.
"""

from __future__ import annotations

import torch

from .inline_cpp import InlineExtension

_SOURCE = r"""
@ATEN_HEADERS@
#include <cmath>
#include <cstring>

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

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2
              && x.is_contiguous(), "cpu_ops: x must be a contiguous [rows, hidden] float32 CPU tensor");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.is_contiguous()
              && w.dim() == 1 && w.size(0) == x.size(1), "cpu_ops: weight must be float32 [hidden]");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_rows(x, w);
  auto out = at::empty_like(x);
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

at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps) {
  check_rows(x, w);
  check_rows(residual, w);
  TORCH_CHECK(residual.sizes() == x.sizes(), "cpu_ops: x and residual differ in shape");
  auto out = at::empty_like(x);
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

// dst [N, H, D] (contiguous) row slots[r] = src [T, H, D] row r (heads and dims contiguous,
// any row stride), for every r; every slot checked against N first.
void store_rows(at::Tensor dst, at::Tensor slots, at::Tensor src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.scalar_type() == at::kFloat
              && src.scalar_type() == at::kFloat && dst.dim() == 3 && src.dim() == 3
              && dst.is_contiguous() && src.size(1) == dst.size(1) && src.size(2) == dst.size(2)
              && src.stride(2) == 1 && src.stride(1) == src.size(2),
              "cpu_ops.store_rows: float32 CPU dst [N, H, D] (contiguous) and src [T, H, D] "
              "(heads and dims contiguous)");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1
              && slots.is_contiguous() && slots.size(0) == src.size(0),
              "cpu_ops.store_rows: slots must be a contiguous int64 [T] CPU tensor");
  const int64_t T = src.size(0), N = dst.size(0), W = dst.size(1) * dst.size(2), ss = src.stride(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < T; ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < N, "cpu_ops.store_rows: slot ", sp[r], " outside [0, ", N, ")");
  const float* src_p = src.data_ptr<float>();
  float* dst_p = dst.data_ptr<float>();
  at::parallel_for(0, T, grain(W), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      std::memcpy(dst_p + sp[r] * W, src_p + r * ss, W * sizeof(float));
  });
}

// t [T, H, D] (last dim contiguous), cos/sin [T, D] contiguous; in place.
void rotary_(at::Tensor t, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 3
              && t.stride(2) == 1 && t.size(2) % 2 == 0,
              "cpu_ops.rotary_: t must be a float32 [T, H, D] CPU view with contiguous, even D");
  for (const auto& c : {cos, sin})
    TORCH_CHECK(c.device().is_cpu() && c.scalar_type() == at::kFloat && c.is_contiguous()
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

_EXT = InlineExtension("kvharbor_cpu_ops", _SOURCE, ["rms_norm", "add_rms_norm", "rotary_", "store_rows"],
                      "KVH_CPU_OPS",
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


def store_rows(dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[slots[r]] = src[r]`` for every row ``r``: ``dst`` ``[N, H, D]`` contiguous (a KV
    cache's slots), ``src`` ``[T, H, D]`` with contiguous heads and dims (any row stride: the k
    or v columns of the packed qkv product), ``slots`` int64 ``[T]``, each checked to be in
    ``[0, N)``. One copy per row, where ``index_copy_`` went through TensorIterator."""
    _EXT.module.store_rows(dst, slots, src)
