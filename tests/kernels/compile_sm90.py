"""Compile the kernels ahead of time for an H100 (sm_90) on a machine without a GPU.

The interpreter accepts code the real compiler rejects (and vice versa), so this runs the
full Triton -> PTX -> cubin pipeline (ptxas ships with Triton). Run as a script *without*
``TRITON_INTERPRET``; prints one ``ok <name>`` line per compiled variant.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvharbor.kernels.paged_attention import _paged_attn_kernel, _reduce_splits_kernel  # noqa: E402
from kvharbor.kernels.store_kv import _store_kv_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SCALARS = {"sm_scale": "fp32", "stride_cb": "i64"}     # every other scalar is i32


def compile_variant(fn, pointers: dict[str, str], constexprs: dict) -> None:
    """Compile ``fn`` with pointer types ``pointers`` (default ``*fp32``) and ``constexprs``."""
    sig = {}
    for name, param in zip(fn.arg_names, fn.params):
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*fp32")
        else:
            sig[name] = SCALARS.get(name, "i32")
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=TARGET,
                   options={"num_warps": 4})
    print("ok", fn.__name__, {k: v for k, v in constexprs.items() if k in ("QUANT", "NUM_SPLITS")})


def main() -> None:
    attn = dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=4, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128,
                BLOCK_SIZE=16, QUANT=1, NUM_SPLITS=4, USE_WINDOW=True, FP32_DOT=False,
                DOT_UPCAST=False)
    compile_variant(_paged_attn_kernel, {"q_ptr": "*bf16", "k_cache_ptr": "*i8",
                                         "v_cache_ptr": "*i8", "bt_ptr": "*i32",
                                         "seq_lens_ptr": "*i32", "qsl_ptr": "*i32"}, attn)
    attn.update(GROUP=3, QUANT=2, NUM_SPLITS=1, USE_WINDOW=False, BLOCK_SIZE=1, HEAD_DIM=32,
                BLOCK_D=32, BLOCK_Q=16)
    compile_variant(_paged_attn_kernel, {"q_ptr": "*fp16", "k_cache_ptr": "*fp8e4nv",
                                         "v_cache_ptr": "*fp8e4nv", "bt_ptr": "*i32",
                                         "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
                                         "out_ptr": "*fp16"}, attn)
    compile_variant(_reduce_splits_kernel, {"out_ptr": "*bf16"},
                    dict(NUM_SPLITS=5, SPLITS_PAD=8, HEAD_DIM=128, BLOCK_D=128))
    for cache in ("*i8", "*fp8e4nv"):
        compile_variant(_store_kv_kernel, {"key_ptr": "*bf16", "value_ptr": "*bf16",
                                           "key_cache_ptr": cache, "value_cache_ptr": cache,
                                           "slot_ptr": "*i64"},
                        dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_T=16,
                             QUANT=1 if cache == "*i8" else 2))


if __name__ == "__main__":
    main()
    sys.exit(0)
