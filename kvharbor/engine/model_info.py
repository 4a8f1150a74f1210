"""What the gateway needs to know about a model, without loading torch or weights.

The gateway tokenizes and checks the context length; it never runs the model. Keeping these
lookups out of ``kvharbor.engine.models`` (which builds transformers' model configs, and with
them imports torch) lets the process that builds the app (``serve run kvharbor.app``, which
imports the gateway's module) reach ``ray.init`` without importing torch: seconds sooner on a
small host. (A gateway replica still loads torch when it computes the model's identity from
its transformers config, ``model_identity``.)
"""

from __future__ import annotations

BUILTIN_NAMES = ("kvharbor/tiny-llama", "kvharbor/tiny-qwen2", "kvharbor/tiny-mistral")
"""The builtin models (``kvharbor.engine.models.BUILTIN_MODELS`` holds their configs)."""
BUILTIN_CONTEXT = 4096
"""The builtin models' ``max_position_embeddings``."""


def load_tokenizer(name: str):
    """The tokenizer of ``name`` without loading weights (for the gateway).

    Raises:
        ValueError: ``name`` is under ``kvharbor/`` but not a builtin model.
    """
    if name in BUILTIN_NAMES:
        from kvharbor.engine.tokenizer import byte_tokenizer  # noqa: PLC0415

        return byte_tokenizer()
    if name.startswith("kvharbor/"):
        raise ValueError(f"unknown builtin model {name!r}; choose one of {sorted(BUILTIN_NAMES)}")
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(name)


def model_context_length(name: str) -> int:
    """The model's maximum context (``max_position_embeddings``) without loading weights."""
    if name in BUILTIN_NAMES:
        return BUILTIN_CONTEXT
    from transformers import AutoConfig  # noqa: PLC0415

    config = AutoConfig.from_pretrained(name)
    return int(getattr(config, "max_position_embeddings", None) or 2048)
