"""Per-layer, per-KV-head scales for quantized (int8 / fp8) KV caches.

Scales are calibrated once, when the cache is made: the model runs on a fixed pseudo-random
token sequence with a full-precision scratch cache, and each head's scale is
``margin * max|x| / qmax``. Values beyond the calibrated range are clamped when stored.
Scales cost no bytes per token, so an int8 cache is exactly half of fp16.
"""

from __future__ import annotations

import torch

from kvharbor.kernels import LayerKVCache, ReferenceBackend

from .block_pool import BlockId, KVCacheBlock

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
CALIBRATION_TOKENS = 512
MARGIN = 1.25


class _RecordingBackend(ReferenceBackend):
    """Reference attention that records the running max |K| and |V| per layer and head."""

    def __init__(self, caches: list[LayerKVCache]):
        self.amax = {id(c): [None, None] for c in caches}

    def store_kv(self, key, value, cache, slot_mapping):
        rec = self.amax[id(cache)]
        for i, x in enumerate((key, value)):
            m = x.detach().abs().amax(dim=(0, 2)).float()             # [Hkv]
            rec[i] = m if rec[i] is None else torch.maximum(rec[i], m)
        ReferenceBackend.store_kv(key, value, cache, slot_mapping)


def calibrate_kv_scales(runner, cache_dtype: torch.dtype) -> None:
    """Fill ``k_scale``/``v_scale`` of every layer of ``runner.caches``."""
    from .model_runner import ScheduledRequest  # noqa: PLC0415 - avoid an import cycle
    from .request import Request, SamplingParams  # noqa: PLC0415

    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (CALIBRATION_TOKENS,), generator=gen).tolist()
    bs = runner.block_size
    nblocks = -(-CALIBRATION_TOKENS // bs)
    scratch = [LayerKVCache(torch.zeros((nblocks, bs, runner.num_kv_heads, runner.head_dim),
                                        dtype=runner.dtype, device=runner.device),
                            torch.zeros((nblocks, bs, runner.num_kv_heads, runner.head_dim),
                                        dtype=runner.dtype, device=runner.device))
               for _ in range(runner.num_layers)]
    recorder = _RecordingBackend(scratch)
    req = Request("calibration", tokens, SamplingParams(max_tokens=1))
    req.blocks = [KVCacheBlock(BlockId(i)) for i in range(nblocks)]   # scratch ids, not the pool's
    real_caches, real_backend = runner.caches, runner.backend
    runner.caches, runner.backend = scratch, recorder
    try:
        runner.forward_logits([ScheduledRequest(req, CALIBRATION_TOKENS)])
    finally:
        runner.caches, runner.backend = real_caches, real_backend
    for cache, s in zip(runner.caches, scratch):
        kmax, vmax = recorder.amax[id(s)]
        cache.k_scale = (kmax.clamp_min(1e-6) * MARGIN / QMAX[cache_dtype]).to(runner.device)
        cache.v_scale = (vmax.clamp_min(1e-6) * MARGIN / QMAX[cache_dtype]).to(runner.device)
