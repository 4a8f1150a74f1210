"""C++ kernels built on first use with the system compiler (``torch.utils.cpp_extension``).

The build is cached under ``~/.cache/torch_extensions`` (or ``TORCH_EXTENSIONS_DIR``, e.g. where
the home folder is read-only), in a folder per extension and Python environment (two
virtualenvs' include paths differ, and each would rebuild the other's copy). A missing
compiler, headers or ninja leaves the extension unavailable and the caller on its torch
fallback.

torch serializes builds of one folder with a lock *file* (``FileBaton``) that a killed builder
leaves behind, and every later load then waits for it forever: Ctrl-C on the first ``serve
run`` while replicas compiled left each replica of the next one stuck in ``__init__``. Builds
here take an ``flock`` on the folder first (the kernel drops it when its holder dies); its
holder is the only builder, so a lock file it finds is stale and is removed.

Every function is bound without the GIL (``InlineExtension.bindings``), as torch's own ops
are: a replica's event loop runs while its step thread is inside a kernel.

A kernel includes only the ATen headers it uses (``ATEN_HEADERS``: the tensor, ``empty``,
``parallel_for``) and the bindings only torch's pybind glue, not ``torch/extension.h`` (the
whole C++ frontend: autograd, nn, optim, serialization), which ``load_inline`` adds unless told
not to. Parsing that header was most of each build: a fresh build took 50-57 s per extension and
a trivial one 60 s, about 3.6 minutes for the four on the first ``serve run`` or test run of a
new environment (2-core AMD EPYC).

Every extension is built with ``-fopenmp``: ATen's ``parallel_for`` is inlined from headers,
and without OpenMP its pragma is dropped and every call runs on one thread. At run time the
extension shares torch's own libgomp, already loaded under the same soname.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import threading
from pathlib import Path


# What a kernel source needs from ATen (spliced in where it says @ATEN_HEADERS@): tensors and
# their dtypes, TORCH_CHECK, at::empty / at::empty_like and at::parallel_for.
ATEN_HEADERS = r"""
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
"""

# SIMD helpers shared by the attention kernels (InlineExtension splices them in where a source
# says @SIMD_MATH@, after its includes). KVH_AVX2 is defined when the compiler targets AVX2 and
# FMA (``V8``: 8 lanes), KVH_AVX512 when it also targets AVX-512F (``V16``: 16 lanes;
# KVH_NO_AVX512 opts out). Each lane width is a struct of the same few operations, so the
# exp polynomial and the row loops built on them are written once, as templates.
SIMD_MATH = r"""
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVH_AVX2 1
namespace {
struct V8 {
  using T = __m256;
  static constexpr int L = 8;
  static T set(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T fnma(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }
  static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^n for integral n in [-126, 127]: n + 127 shifted into the exponent bits.
  static T scale2(T p, T n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static float hmax(T v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
  static float hsum(T v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
};

#if defined(__AVX512F__) && !defined(KVH_NO_AVX512)
#define KVH_AVX512 1
struct V16 {
  using T = __m512;
  static constexpr int L = 16;
  static T set(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T fnma(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }
  static T round(T x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T scale2(T p, T n) { return _mm512_scalef_ps(p, n); }
  static float hmax(T v) { return _mm512_reduce_max_ps(v); }
  static float hsum(T v) { return _mm512_reduce_add_ps(v); }
};
#endif

// exp for x <= 0 (scores minus their running max): Cody-Waite reduction to r in
// [-ln2/2, ln2/2], a degree-7 Taylor polynomial (relative error < 1e-8 there), times 2^n.
// Inputs below -87 give ~1e-38 instead of a denormal or 0.
template <class V>
inline typename V::T exp_nonpos(typename V::T x) {
  x = V::max(x, V::set(-87.0f));
  const typename V::T n = V::round(V::mul(x, V::set(1.44269504088896341f)));
  typename V::T r = V::fnma(n, V::set(0.693359375f), x);
  r = V::fnma(n, V::set(-2.12194440e-4f), r);
  typename V::T p = V::set(1.f / 5040);
  p = V::fma(p, r, V::set(1.f / 720));
  p = V::fma(p, r, V::set(1.f / 120));
  p = V::fma(p, r, V::set(1.f / 24));
  p = V::fma(p, r, V::set(1.f / 6));
  p = V::fma(p, r, V::set(0.5f));
  p = V::fma(p, r, V::set(1.f));
  p = V::fma(p, r, V::set(1.f));
  return V::scale2(p, n);
}

// max(mx, s[j..]) over the whole vectors of s[j, n), advancing j past them.
template <class V>
inline float max_run(const float* s, int64_t& j, int64_t n, float mx) {
  typename V::T v = V::set(mx);
  for (; j + V::L <= n; j += V::L) v = V::max(v, V::load(s + j));
  return V::hmax(v);
}

// s = exp(s - mx) over the whole vectors of s[j, n), advancing j past them; returns their sum.
template <class V>
inline float exp_run(float* s, int64_t& j, int64_t n, float mx) {
  const typename V::T m = V::set(mx);
  typename V::T acc = V::set(0.f);
  for (; j + V::L <= n; j += V::L) {
    const typename V::T p = exp_nonpos<V>(V::sub(V::load(s + j), m));
    V::store(s + j, p);
    acc = V::add(acc, p);
  }
  return V::hsum(acc);
}
}  // namespace
#endif
"""


EXTENSIONS: list[InlineExtension] = []   # every extension defined so far, built or not


def build_all() -> None:
    """Build every defined extension that is not built yet, all at once: each build is one
    compiler process on one core, so on a machine with several the first start of an engine
    waits for the slowest build instead of the sum (two cores: ~50 s instead of ~100 s)."""
    builders = [threading.Thread(target=ext.available, name=f"build {ext.name}", daemon=True)
                for ext in EXTENSIONS if ext.module is None and ext.failed is None]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()


class InlineExtension:
    """One lazily built C++ extension; ``env`` set to ``0`` disables it."""

    def __init__(self, name: str, source: str, functions: list[str], env: str,
                 extra_cflags: tuple[str, ...] = ()) -> None:
        self.name, self.functions, self.env = name, functions, env
        self.source = (source.replace("@ATEN_HEADERS@", ATEN_HEADERS)
                       .replace("@SIMD_MATH@", SIMD_MATH))
        self.cflags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
        self.module = None
        self.failed: str | None = None
        self._lock = threading.Lock()
        EXTENSIONS.append(self)

    def available(self) -> bool:
        """True when built (building it now if needed) and not disabled by ``env``."""
        if os.environ.get(self.env, "1") == "0":
            return False
        with self._lock:
            if self.module is None and self.failed is None:
                try:
                    self.module = self._build()
                except Exception as e:  # noqa: BLE001 - no compiler, headers or ninja
                    self.failed = f"{type(e).__name__}: {e}"
        return self.module is not None

    def build_directory(self) -> Path:
        """This extension's build folder for this Python environment and torch."""
        import torch  # noqa: PLC0415
        from torch.utils.cpp_extension import get_default_build_root  # noqa: PLC0415

        env = hashlib.sha1(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:10]
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch's
        return Path(root) / f"{self.name}-{env}"

    def _build(self):
        import inspect  # noqa: PLC0415

        from torch.utils.cpp_extension import load_inline  # noqa: PLC0415

        # a torch without the switch prepends torch/extension.h: slower to build, the same code
        light = ({"no_implicit_headers": True}
                 if "no_implicit_headers" in inspect.signature(load_inline).parameters else {})
        folder = self.build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "kvharbor.flock", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)         # released on close, or when we die
            (folder / "lock").unlink(missing_ok=True)  # torch's baton: stale if here now
            return load_inline(self.name, cpp_sources=[self.source, self.bindings()],
                               extra_cflags=self.cflags, extra_ldflags=["-fopenmp"],
                               build_directory=str(folder), verbose=False, **light)

    def bindings(self) -> str:
        """The Python module: each function released from the GIL while it runs (they read and
        write tensors only), so the replica's event loop streams tokens and takes arrivals on
        the other core while a step computes; torch's own ops release it the same way.
        (``load_inline(functions=...)`` would hold it for the whole call.)"""
        defs = "\n".join(f'  m.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");'
                         for f in self.functions)
        return ("#include <torch/csrc/Exceptions.h>\n#include <torch/csrc/utils/pybind.h>\n"
                f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}\n}}\n")
