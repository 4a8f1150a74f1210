"""The "kvharbor" attention implementation registered with transformers.

Every scheduled token of a step is flattened into one sequence (batch 1) with explicit
position ids. Per layer, the attention function stores the new K/V into the paged cache at
``slot_mapping`` and attends over each sequence's blocks. The per-step ``AttentionContext``
reaches it through a context variable the runner sets for the forward (:func:`stepping`: per
thread, so engines on other threads do not see it), not through the model's forward kwargs,
which some models' layers do not pass on to their attention (e.g. StableLM).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvharbor.kernels import AttentionPlan, paged_attention_cpu

from .step_budget import StepInterrupt

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
    interrupt: StepInterrupt | None = None  # a higher-class arrival may cut the step short


_STEP: ContextVar[AttentionContext | None] = ContextVar("kvharbor_step", default=None)


@contextmanager
def stepping(ctx: AttentionContext) -> Iterator[None]:
    """``ctx`` is the attention context of the forward run inside (see the module doc)."""
    token = _STEP.set(ctx)
    try:
        yield
    finally:
        _STEP.reset(token)


def paged_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
               layer_idx: int, scaling: float, sliding_window: int | None,
               rows: Sequence[int] | None = None) -> torch.Tensor:
    """Store this step's K/V of layer ``layer_idx`` and attend. Token-major views in
    (``q`` ``[T, H, D]``, ``k``/``v`` ``[T, Hkv, D]``, any strides), ``[T, H, D]`` out.
    ``rows``: the ascending rows whose output the caller reads (None: all); the CPU hot path
    may leave the others unwritten (see :func:`paged_attention_cpu`)."""
    if ctx.interrupt is not None:
        ctx.interrupt.check(layer_idx)        # raises StepInterrupted: the step is abandoned
    cache = ctx.caches[layer_idx]
    if ctx.plan is not None and sliding_window == ctx.plan_window:
        # The CPU hot path: no copies of q/k/v, the plan shared by all layers.
        ctx.backend.store_kv(k, v, cache, ctx.slot_mapping)
        return paged_attention_cpu(q, k, v, cache, ctx.plan, scaling, rows)
    if not getattr(ctx.backend, "strided", False):   # Triton's kernels take row/head strides
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    ctx.backend.store_kv(k, v, cache, ctx.slot_mapping)
    return ctx.backend.paged_attention(q, cache, ctx.block_tables, ctx.seq_lens,
                                       ctx.query_start_loc, scaling, sliding_window, ctx.max_seq_len)


def kvharbor_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       sliding_window=None, **kwargs):
    """transformers attention interface: query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]``."""
    ctx = _STEP.get()
    if ctx is None:
        raise RuntimeError("kvharbor attention runs only inside an engine step (see stepping)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = paged_step(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                     ctx, module.layer_idx, scaling, sliding_window)
    return out.unsqueeze(0), None                # [1, T, H, D]


def _no_mask(*args, **kwargs):
    """Masking happens inside the paged attention; transformers builds no mask."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, kvharbor_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
