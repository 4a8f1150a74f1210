"""kvharbor: multi-tenant LLM serving on Ray Serve with a paged, QoS-aware KV cache.

``from kvharbor import LLM, SamplingParams`` for offline use; ``serve run kvharbor.app`` to serve.
Names are resolved lazily (PEP 562), so ``import kvharbor.tenants`` does not load torch and
``import kvharbor`` does not start Ray.
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RepetitionDetectionParams", "LoRARequest",
           "PoolingParams", "BeamSearchParams", "RequestOutput", "app", "build_app"]

_LAZY = {"LLM": ("kvharbor.engine.llm", "LLM"),
         "SamplingParams": ("kvharbor.engine.request", "SamplingParams"),
         "RequestOutput": ("kvharbor.engine.request", "RequestOutput"),
         "StructuredOutputsParams": ("kvharbor.engine.structured_output", "StructuredOutputsParams"),
         "RepetitionDetectionParams": ("kvharbor.engine.repetition", "RepetitionDetectionParams"),
         "LoRARequest": ("kvharbor.engine.lora", "LoRARequest"),
         "PoolingParams": ("kvharbor.engine.pooling", "PoolingParams"),
         "BeamSearchParams": ("kvharbor.engine.beam_search", "BeamSearchParams"),
         "build_app": ("kvharbor.platform.app", "build_app"),
         "app": ("kvharbor.platform.app", "app")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kvharbor' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
