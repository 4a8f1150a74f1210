"""kvharbor: multi-tenant LLM serving on Ray Serve with a paged, QoS-aware KV cache.

``from kvharbor import LLM, SamplingParams`` for offline use; ``serve run kvharbor.app`` to serve.
"""

from __future__ import annotations

from kvharbor.engine.llm import LLM
from kvharbor.engine.request import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "app", "build_app"]


def __getattr__(name: str):
    """Lazy ``app`` / ``build_app`` so importing kvharbor does not import Ray Serve."""
    if name in ("app", "build_app"):
        from kvharbor.platform import app as app_module  # noqa: PLC0415

        return app_module.app if name == "app" else app_module.build_app
    raise AttributeError(f"module 'kvharbor' has no attribute {name!r}")
