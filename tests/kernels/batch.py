"""Builds random flattened batches over a paged cache for the kernel tests.

The cache is filled through the torch reference (``store_kv_ref``), so attention tests do not
depend on the Triton store kernel. Blocks no sequence owns, and the padding entries of the
block tables, point at *poisoned* memory (NaN for float caches) so a kernel that reads past a
sequence's end produces NaN instead of passing by luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvharbor.engine.kv_calibration import QMAX
from kvharbor.kernels import LayerKVCache
from kvharbor.kernels.reference import store_kv_ref

# Where the kernel tests build their tensors: the GPU when one is present (the Triton kernels
# then compile for it), else the CPU (Triton in its interpreter).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# atol = rtol. Observed max errors on these shapes (outputs up to ~3): fp32 2e-6, fp16 and bf16
# one ulp of the output (2e-3 / 1.6e-2), so these allow a few ulps and no more.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


@dataclass(slots=True)
class Batch:
    """One step's inputs; ``key``/``value``/``slot_mapping`` cover every cached token."""

    query: torch.Tensor            # [T, H, D]
    cache: LayerKVCache            # [N, bs, Hkv, D] each
    block_tables: torch.Tensor     # [B, max_blocks] int32
    seq_lens: torch.Tensor         # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    key: torch.Tensor              # [sum(kv_lens), Hkv, D] in the query dtype
    value: torch.Tensor
    slot_mapping: torch.Tensor     # [sum(kv_lens)] int64

    @property
    def args(self) -> tuple:
        """Positional args of ``paged_attention``/``paged_attention_ref`` after the query."""
        c = self.cache
        return (c.key, c.value, self.block_tables, self.seq_lens, self.query_start_loc)


def empty_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                cache_dtype: torch.dtype, poison: bool) -> torch.Tensor:
    """An uninitialised cache; with ``poison`` NaN-filled, or -128 for int8 (a value the
    quantizer never writes, as it clamps to +-127)."""
    cache = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype, device=DEVICE)
    if poison and cache_dtype == torch.float8_e4m3fn:
        cache.view(torch.uint8).fill_(0x7F)
    elif poison and cache_dtype == torch.int8:
        cache.fill_(-128)
    elif poison:
        cache.fill_(float("nan"))
    return cache


def make_batch(q_lens, kv_lens, *, heads, kv_heads, head_dim, block_size, dtype,
               cache_dtype=None, num_blocks=None, min_block_id=0, seed=0) -> Batch:
    """Random batch: sequence ``b`` has ``q_lens[b]`` new tokens and ``kv_lens[b]`` in total.

    Block ids are distinct, drawn from ``[min_block_id, num_blocks)``; ``num_blocks`` defaults
    to what the batch needs plus 3 spare (poisoned) blocks. Huge caches are not poisoned (only
    touched pages cost memory).
    """
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    per_seq = [-(-n // block_size) for n in kv_lens]
    need = sum(per_seq)
    num_blocks = num_blocks or min_block_id + need + 3
    ids = min_block_id + torch.randperm(num_blocks - min_block_id, generator=g)[:need + 1]
    spare = int(ids[-1])                                   # poisoned padding target
    tables = torch.full((len(kv_lens), max(per_seq)), spare, dtype=torch.int32)
    slots, pos = [], 0
    for b, (n, nb) in enumerate(zip(kv_lens, per_seq)):
        tables[b, :nb] = ids[pos:pos + nb].int()
        pos += nb
        p = torch.arange(n)
        slots.append(tables[b, p // block_size].long() * block_size + p % block_size)
    slot_mapping = torch.cat(slots)
    total = int(slot_mapping.numel())
    key = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    k_scale = v_scale = None
    if cache_dtype in QMAX:
        k_scale = key.float().abs().amax(dim=(0, 2)) / QMAX[cache_dtype]
        v_scale = value.float().abs().amax(dim=(0, 2)) / QMAX[cache_dtype]
    poison = num_blocks * block_size * kv_heads * head_dim < 2**26
    cache = LayerKVCache(
        empty_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, poison),
        empty_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype, poison),
        k_scale, v_scale)
    key, value, slot_mapping = key.to(DEVICE), value.to(DEVICE), slot_mapping.to(DEVICE)
    if k_scale is not None:
        cache.k_scale, cache.v_scale = k_scale.to(DEVICE), v_scale.to(DEVICE)
    store_kv_ref(key, value, cache.key, cache.value, slot_mapping, cache.k_scale, cache.v_scale)
    query = (2.0 * torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)).to(DEVICE)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return Batch(query, cache, tables.to(DEVICE), torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
                 qsl, key, value, slot_mapping)
