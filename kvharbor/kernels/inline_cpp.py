"""C++ kernels built on first use with the system compiler (``torch.utils.cpp_extension``).

The build is cached under ``~/.cache/torch_extensions``. A missing compiler, headers or ninja
leaves the extension unavailable and the caller on its torch fallback. Every extension is built
with ``-fopenmp``: ATen's ``parallel_for`` is inlined from headers, and without OpenMP its
pragma is dropped and every call runs on one thread. At run time the extension shares torch's
own libgomp, already loaded under the same soname.
"""

from __future__ import annotations

import os
import threading


# AVX2 helpers shared by the attention kernels (InlineExtension splices them in where a source
# says @AVX2_MATH@, after its includes): KVH_AVX2 is defined when the compiler targets AVX2 and FMA,
# KVH_AVX512 when it also targets AVX-512F (16-lane exp_nonpos16; KVH_NO_AVX512 opts out).
AVX2_MATH = r"""
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVH_AVX2 1
namespace {
// exp for x <= 0 (scores minus their running max): Cody-Waite reduction to r in
// [-ln2/2, ln2/2], a degree-7 Taylor polynomial (relative error < 1e-8 there), times 2^n.
// Inputs below -87 give ~1e-38 instead of a denormal or 0.
inline __m256 exp_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

#if defined(__AVX512F__) && !defined(KVH_NO_AVX512)
#define KVH_AVX512 1
// exp_nonpos on 16 lanes: the same reduction and polynomial, 2^n applied by scalef.
inline __m512 exp_nonpos16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif
}  // namespace
#endif
"""


class InlineExtension:
    """One lazily built C++ extension; ``env`` set to ``0`` disables it."""

    def __init__(self, name: str, source: str, functions: list[str], env: str,
                 extra_cflags: tuple[str, ...] = ()) -> None:
        self.name, self.functions, self.env = name, functions, env
        self.source = source.replace("@AVX2_MATH@", AVX2_MATH)
        self.cflags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
        self.module = None
        self.failed: str | None = None
        self._lock = threading.Lock()

    def available(self) -> bool:
        """True when built (building it now if needed) and not disabled by ``env``."""
        if os.environ.get(self.env, "1") == "0":
            return False
        with self._lock:
            if self.module is None and self.failed is None:
                try:
                    from torch.utils.cpp_extension import load_inline  # noqa: PLC0415

                    self.module = load_inline(self.name, cpp_sources=self.source,
                                              functions=self.functions, extra_cflags=self.cflags,
                                              extra_ldflags=["-fopenmp"], verbose=False)
                except Exception as e:  # noqa: BLE001 - no compiler, headers or ninja
                    self.failed = f"{type(e).__name__}: {e}"
        return self.module is not None
