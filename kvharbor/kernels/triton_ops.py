"""Fused Triton forms of the small per-layer ops of a Llama-family forward on a GPU.

The GPU twin of :mod:`kvharbor.kernels.cpu_ops`. transformers writes each RMSNorm, the rotary
embedding and the SiLU gate as 5-12 tensor ops; a decode step of a 0.5B model launches ~40
kernels per layer, most of them a few microseconds of nothing, so even replayed from a CUDA
graph the step is bound by kernel count, not bytes. Here each is one kernel:

- :func:`rms_norm`: ``w * (x * rsqrt(mean(x^2) + eps))``, transformers' ``LlamaRMSNorm``.
- :func:`add_rms_norm`: ``residual += x`` in place, then the norm of the new ``residual``.
- :func:`rotary_`: ``x * cos + rotate_half(x) * sin`` in place on q and k, ``[T, H, D]`` views
  (the q and k columns of the packed qkv product, any row and head strides).
- :func:`silu_mul`: ``silu(gate) * up`` of the packed ``[T, 2 * I]`` gate/up product.

Every intermediate is rounded to the tensor dtype where transformers' ops round it (each bf16
product, sum and cast), in fp32 registers otherwise. In Triton's interpreter that makes the
rotary embedding and the residual add bit-identical to transformers (fp32/fp16; the
interpreter truncates bf16 casts). Compiled for a GPU they are close, not identical: measured
on an H200, the rotary embedding differed by one ulp in fp16/bf16 and up to 26 ulps in fp32
where its two products nearly cancel (consistent with a product fused into the sum), the SiLU
gate by up to 11 ulps in fp32 (Triton's fast exp), the norms by a few ulps (sum order,
``rsqrt``). ``tests/kernels/test_triton_ops.py`` holds those bounds, on the GPU when present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_r, stride_o,
                 HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)         # residual + x, rounded
        tl.store(res_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n
    y = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)                   # hs.to(input_dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> torch.Tensor:
    rows, n = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.shape == (n,)
    out = torch.empty((rows, n), dtype=torch.result_type(weight, x), device=x.device)
    if rows:
        res = residual if residual is not None else x
        assert res.stride(1) == 1 and res.shape == x.shape
        _norm_kernel[(rows,)](x, res, weight, out, n, float(eps), x.stride(0), res.stride(0),
                              out.stride(0), HAS_RES=residual is not None,
                              BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` of ``x`` ``[T, n]`` (rows may be strided)."""
    return _norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += x`` (in place, rounded as torch's add), then ``rms_norm(residual)``."""
    return _norm(x, residual, weight, eps)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, n_q_heads, stride_qt, stride_qh,
                   stride_kt, stride_kh, stride_ct, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < n_q_heads:
        base = q_ptr + t * stride_qt + head * stride_qh
    else:
        base = k_ptr + t * stride_kt + (head - n_q_heads) * stride_kh
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    x1 = tl.load(base + i, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + i, mask=ok, other=0.0)
    dt = x1.dtype
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + i, mask=ok, other=0.0).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # (x * cos) + (rotate_half(x) * sin), rotate_half(x) = cat(-x2, x1): each product and the
    # sum rounded to the tensor dtype, as transformers' elementwise ops round them.
    o1 = ((a1 * c1).to(dt).to(tl.float32) + (-a2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base + i, o1, mask=ok)
    tl.store(base + HALF + i, o2, mask=ok)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` in place by ``cos``/``sin``
    ``[T, D]`` (in the q/k dtype, as transformers' rotary module returns them)."""
    t, h, d = q.shape
    assert k.shape[0] == t and k.shape[2] == d and d % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert cos.shape == (t, d) and cos.dtype == q.dtype == k.dtype
    if t:
        _rotary_kernel[(t, h + k.shape[1])](q, k, cos, sin, h, q.stride(0), q.stride(1),
                                            k.stride(0), k.stride(1), cos.stride(0),
                                            HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2))
    return q, k


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)                       # F.silu, rounded
    out = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)          # * up, rounded
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` of the packed gate/up product ``[T, 2 * I]``."""
    t, two_i = gate_up.shape
    assert gate_up.stride(1) == 1 and two_i % 2 == 0
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0),
                                                         out.stride(0), BLOCK=block)
    return out
