"""What the gateway needs to know about a model, without loading torch or weights.

The gateway tokenizes, checks the context length and computes the model's identity (the root
of its routing hashes, ``model_identity``); it never runs the model. Keeping these facts out of
``kvharbor.engine.models`` (which builds transformers' model configs, and with them imports
torch) lets the process that builds the app (``serve run kvharbor.app``) reach ``ray.init``,
and a gateway replica start, without importing torch: seconds of CPU each, on the cores the
LLM replicas load their models on.
"""

from __future__ import annotations

import functools
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace

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


@functools.lru_cache(maxsize=8)
def model_config(name: str):
    """The model's transformers config without loading weights (a builtin's: its fields, as
    attributes)."""
    if name in BUILTIN_NAMES:
        return SimpleNamespace(**BUILTIN_SPECS[name][1])
    from transformers import AutoConfig  # noqa: PLC0415

    return AutoConfig.from_pretrained(name)


def model_context_length(name: str) -> int:
    """The model's maximum context (:func:`context_length`) without loading weights."""
    if name in BUILTIN_NAMES:
        return BUILTIN_CONTEXT
    from transformers import AutoConfig  # noqa: PLC0415

    return context_length(AutoConfig.from_pretrained(name))


_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length", "max_seq_length", "seq_len")
_STRETCHING_ROPE = ("linear", "dynamic", "yarn")
"""RoPE scalings that stretch the positions a model was trained on by their ``factor``
(``llama3`` and ``longrope`` configs already give the stretched length)."""


def context_length(config) -> int:
    """The longest prompt + output a model with transformers config ``config`` takes, as vLLM
    derives it: the smallest length the config sets under any of :data:`_LENGTH_KEYS` (2048
    when none), times the factor of a RoPE scaling that stretches positions (YaRN's from its
    ``original_max_position_embeddings``): a Qwen2.5 checkpoint given YaRN x4 over 32,768
    positions takes 131,072 tokens."""
    lengths = [v for key in _LENGTH_KEYS if isinstance(v := getattr(config, key, None), int) and v > 0]
    length = min(lengths, default=2048)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind in _STRETCHING_ROPE and (factor := rope.get("factor") or 1.0) > 1:
        base = rope.get("original_max_position_embeddings") if kind == "yarn" else None
        length = int((base or length) * factor)
    return length


NO_CHAT_TEMPLATE = ("the model's tokenizer has no chat template: give one with chat_template=<a Jinja "
                    "file or the template itself> (vLLM's --chat-template), or send prompts to "
                    "/v1/completions")


def chat_template_text(value: str | None) -> str | None:
    """vLLM's ``chat_template`` option as the template's text: the path of a Jinja file, or the
    template itself (a text with ``{`` in it). Raises ValueError for a path that names no file
    or a template Jinja cannot parse, so a bad one fails at start, not at each chat request."""
    if value is None:
        return None
    text = value
    if "{" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template "
                             "(a template has {{ ... }} or {% ... %} in it)")
        text = path.read_text()
    import jinja2  # noqa: PLC0415 - transformers' own dependency, needed only here

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not a valid Jinja template: {e} (line {e.lineno})") from None
    return text


SAMPLING_DEFAULT_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                         "top_k", "top_p", "min_p", "max_new_tokens")
"""The fields of a model's ``generation_config.json`` that become its default sampling
parameters (vLLM's list; ``max_new_tokens`` becomes ``max_tokens``)."""


def sampling_defaults(model: str, generation_config: str = "auto",
                      override: dict | None = None) -> dict:
    """The sampling parameters a request that leaves them unset gets, as vLLM's
    ``--generation-config`` / ``--override-generation-config`` give them: from ``model``'s
    ``generation_config.json`` (``"auto"``), none (``"vllm"``: the neutral values), or the one
    in the folder ``generation_config`` names; ``override`` replaces or adds fields. The builtin
    models have none. Raises ValueError (at start, not per request) for a folder without the
    file, an override key that is not a sampling field, or a value the engine refuses."""
    override = dict(override or {})
    if unknown := sorted(set(override) - set(SAMPLING_DEFAULT_KEYS)):
        raise ValueError(f"override_generation_config takes {', '.join(SAMPLING_DEFAULT_KEYS)}; "
                         f"got {', '.join(unknown)}")
    if generation_config == "vllm" or (generation_config == "auto" and model in BUILTIN_NAMES):
        found = {}
    elif generation_config == "auto":
        found = _generation_config(model)
    else:
        folder = Path(generation_config).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config {generation_config!r} is not 'auto', 'vllm' or a "
                             "folder holding a generation_config.json")
        found = _generation_config(str(folder))
    found.update(override)
    defaults = {k: v for k in SAMPLING_DEFAULT_KEYS if (v := found.get(k)) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    from kvharbor.engine.request import SamplingParams  # noqa: PLC0415 - torch-free too

    try:
        SamplingParams(**defaults).validate()
    except (TypeError, ValueError) as e:
        source = {"auto": f"{model}'s generation_config.json", "vllm": "vLLM's neutral values"}.get(
            generation_config, f"{generation_config}/generation_config.json")
        source += " and override_generation_config" if override else ""
        raise ValueError(f"default sampling parameters {defaults} (from {source}): {e}") from None
    return defaults


def _generation_config(where: str) -> dict:
    """The fields of ``where``'s generation_config.json that differ from transformers'
    defaults, as vLLM reads them ({} without the file: the neutral values)."""
    from transformers import GenerationConfig  # noqa: PLC0415 - torch-free, as this module

    try:
        return GenerationConfig.from_pretrained(where).to_diff_dict()
    except OSError:
        return {}
