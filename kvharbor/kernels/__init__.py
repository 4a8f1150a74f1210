"""Attention kernels over the paged KV cache.

``get_attention_backend`` picks the implementation; every backend exposes ``store_kv`` and
``paged_attention`` with the signatures of :mod:`kvharbor.kernels.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cpu_attention import AttentionPlan, paged_attention_cpu, plan_attention, store_kv_cpu  # noqa: F401
from .reference import paged_attention_ref, store_kv_ref

KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(slots=True)
class LayerKVCache:
    """One layer's paged K/V: ``key``/``value`` ``[N, bs, Hkv, D]``; scales ``[Hkv]`` or None."""

    key: torch.Tensor
    value: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class ReferenceBackend:
    """Torch reference: exact, used on CPU."""

    name = "reference"

    @staticmethod
    def store_kv(key, value, cache: LayerKVCache, slot_mapping) -> None:
        store_kv_ref(key, value, cache.key, cache.value, slot_mapping, cache.k_scale, cache.v_scale)

    @staticmethod
    def paged_attention(query, cache: LayerKVCache, block_tables, seq_lens, query_start_loc,
                        scale, sliding_window=None, max_seq_len=None):
        return paged_attention_ref(query, cache.key, cache.value, block_tables, seq_lens,
                                   query_start_loc, scale, sliding_window, cache.k_scale,
                                   cache.v_scale)


class CpuBackend(ReferenceBackend):
    """The CPU hot path: ``plans`` tells the runner to build one :class:`AttentionPlan` per step
    and call :func:`paged_attention_cpu` with it; ``store_kv`` writes with ``index_copy_``
    (the engine never passes negative slots). Without a plan it is the reference."""

    name = "cpu"
    plans = True

    @staticmethod
    def store_kv(key, value, cache: LayerKVCache, slot_mapping) -> None:
        store_kv_cpu(key, value, cache, slot_mapping)


def get_attention_backend(name: str, device: torch.device | str):
    """Return the backend for ``name`` ("auto" | "cpu" | "reference" | "triton") on ``device``.

    "auto" is Triton on CUDA and the planned CPU path elsewhere.
    """
    device = torch.device(device)
    if name not in ("auto", "cpu", "reference", "triton"):
        raise ValueError(f"attention_backend must be 'auto', 'cpu', 'reference' or 'triton', got {name!r}")
    if name == "reference":
        return ReferenceBackend()
    if name == "cpu" or (name == "auto" and device.type != "cuda"):
        return CpuBackend()
    from .triton_backend import TritonBackend  # noqa: PLC0415 - triton is optional on CPU

    return TritonBackend()


def build_cpu_kernels() -> None:
    """Build the CPU C++ kernels now, concurrently, instead of one after another at first use;
    those disabled by their environment switch, or that cannot build, stay unavailable."""
    from . import cpu_decode, cpu_gemv, cpu_ops, cpu_prefill  # noqa: F401, PLC0415 - define them
    from .inline_cpp import build_all  # noqa: PLC0415

    build_all()
