"""What the gateway needs to know about a model, without loading torch or weights.

The gateway tokenizes, checks the context length and computes the model's identity (the root
of its routing hashes, ``model_identity``); it never runs the model. Keeping these facts out of
``kvharbor.engine.models`` (which builds transformers' model configs, and with them imports
torch) lets the process that builds the app (``serve run kvharbor.app``) reach ``ray.init``,
and a gateway replica start, without importing torch: seconds of CPU each, on the cores the
LLM replicas load their models on.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

VOCAB_SIZE = 259
"""The builtin models' vocabulary: the byte tokenizer's 256 bytes, <pad>, <s> and </s>."""
BUILTIN_CONTEXT = 4096
"""The builtin models' ``max_position_embeddings``."""
_SHAPE = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=BUILTIN_CONTEXT, pad_token_id=256, bos_token_id=257,
              eos_token_id=258, tie_word_embeddings=False, initializer_range=0.08)
BUILTIN_SPECS: dict[str, tuple[str, dict]] = {
    "kvharbor/tiny-llama": ("llama", _SHAPE),
    "kvharbor/tiny-qwen2": ("qwen2", {**_SHAPE, "num_key_value_heads": 4}),
    "kvharbor/tiny-mistral": ("mistral", {**_SHAPE, "sliding_window": 64}),
}
"""Each builtin model's transformers ``model_type`` and the config fields it sets
(``kvharbor.engine.models.BUILTIN_MODELS`` builds the configs from them)."""
BUILTIN_NAMES = tuple(BUILTIN_SPECS)
TRAINED_WEIGHTS: dict[str, Path] = {   # packaged data, found as tenants.yaml's example is
    "kvharbor/tiny-llama": Path(str(files("kvharbor") / "data" / "tiny-llama.safetensors")),
}
"""The builtin models with trained weights (the others are seeded random)."""


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
