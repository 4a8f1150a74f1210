"""The "kvharbor" attention implementation registered with transformers.

Every scheduled token of a step is flattened into one sequence (batch 1) with explicit
position ids. Per layer, the attention function stores the new K/V into the paged cache at
``slot_mapping`` and attends over each sequence's blocks. The per-step ``AttentionContext``
reaches it through the model's forward kwargs (``kvh_ctx=...``), not a global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvharbor.kernels import AttentionPlan, paged_attention_cpu

ATTN_IMPLEMENTATION = "kvharbor"


@dataclass(slots=True)
class AttentionContext:
    """Inputs of one step's attention, shared by all layers.

    slot_mapping:    [T] int64, cache slot of each scheduled token
    block_tables:    [B, max_blocks] int32
    seq_lens:        [B] int32, K/V length per sequence after this step
    query_start_loc: [B + 1] int32, row offsets of each sequence's queries
    """

    caches: list            # one LayerKVCache per layer
    backend: object
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    plan: AttentionPlan | None = None      # the CPU backend's per-step plan (None: other backends)
    plan_window: int | None = None         # the sliding window the plan was built for


def kvharbor_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       sliding_window=None, kvh_ctx: AttentionContext | None = None, **kwargs):
    """transformers attention interface: query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]``."""
    if kvh_ctx is None:
        raise RuntimeError("kvharbor attention needs the engine's per-step context (kvh_ctx)")
    cache = kvh_ctx.caches[module.layer_idx]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if kvh_ctx.plan is not None and sliding_window == kvh_ctx.plan_window:
        # The CPU hot path: no copies of q/k/v, the plan shared by all layers.
        k, v = key[0], value[0]                                        # [Hkv, T, D] views
        kvh_ctx.backend.store_kv(k.transpose(0, 1), v.transpose(0, 1), cache, kvh_ctx.slot_mapping)
        out = paged_attention_cpu(query[0], k, v, cache, kvh_ctx.plan, scaling)
        return out.unsqueeze(0), None                                  # [1, T, H, D]
    q = query[0].transpose(0, 1)                 # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()      # [T, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()
    kvh_ctx.backend.store_kv(k, v, cache, kvh_ctx.slot_mapping)
    out = kvh_ctx.backend.paged_attention(q.contiguous(), cache, kvh_ctx.block_tables,
                                          kvh_ctx.seq_lens, kvh_ctx.query_start_loc, scaling,
                                          sliding_window, kvh_ctx.max_seq_len)
    return out.unsqueeze(0), None                # [1, T, H, D]


def _no_mask(*args, **kwargs):
    """Masking happens inside the paged attention; transformers builds no mask."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, kvharbor_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
