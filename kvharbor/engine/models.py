"""Model loading: builtin tiny models, local checkpoint directories, hub ids.

The builtin models are built from a config and use the byte-level tokenizer, so everything
runs offline. ``kvharbor/tiny-llama`` (the default) loads weights trained briefly on Python's
own reference docs (``kvharbor/data/tiny-llama.safetensors``, made by
``scripts/train_tiny_llama.py``): its predictions have a real model's margins, which is what
quantized-KV accuracy is measured against. The other builtin models keep seeded random
weights; they exist to cover architectures (qkv bias, GQA ratios, sliding window).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig,
                          PretrainedConfig, Qwen2Config)

from .model_info import BUILTIN_SPECS, TRAINED_WEIGHTS, context_length
from .tokenizer import byte_tokenizer

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
BUILTIN_MODELS: dict[str, PretrainedConfig] = {
    name: _CONFIGS[kind](**fields) for name, (kind, fields) in BUILTIN_SPECS.items()}
DEFAULT_MODEL = "kvharbor/tiny-llama"


@dataclass(slots=True)
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    max_model_len: int


def load_model(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LoadedModel:
    """Load ``name``: a builtin id, a local checkpoint directory or a hub id.

    Raises:
        ValueError: the model cannot be found; the message lists the builtin ids.
    """
    if name in BUILTIN_MODELS:
        config = copy.deepcopy(BUILTIN_MODELS[name])   # loading sets fields (dtype): keep the
        # shared config pristine, the model identity the gateway computes without loading is its digest
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            if name not in TRAINED_WEIGHTS:
                _draw_biases(model, config.initializer_range)
        if name in TRAINED_WEIGHTS:
            _load_trained(model, TRAINED_WEIGHTS[name])
        tokenizer = byte_tokenizer()
    elif name.startswith("kvharbor/"):
        raise ValueError(f"unknown builtin model {name!r}; choose one of {sorted(BUILTIN_MODELS)}")
    else:
        model, tokenizer = _load_pretrained(name)
    model = model.to(device=device, dtype=dtype).eval()
    return LoadedModel(name, model, tokenizer, context_length(model.config))


def _draw_biases(model: torch.nn.Module, std: float) -> None:
    """Draw every linear bias like the weights: transformers starts them at zero, and a
    builtin model kept to cover q/k/v biases (Qwen2) must make a path that drops or misplaces
    one give other tokens."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, std)


def _load_trained(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_file  # noqa: PLC0415

    if not path.is_file():
        raise ValueError(f"the builtin weights {path} are missing from this install; "
                         f"reinstall kvharbor or run scripts/train_tiny_llama.py")
    state = load_file(str(path))
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)


def _load_pretrained(name: str):
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        where = "local directory" if os.path.isdir(name) else "hub id"
        raise ValueError(
            f"cannot load model {name!r} as a {where}: {e}. Use a builtin model "
            f"({', '.join(sorted(BUILTIN_MODELS))}), a local checkpoint directory with "
            f"config.json, weights and tokenizer files, or a hub id reachable from here") from e
    return model, tokenizer


def uniform_sliding_window(config) -> int | None:
    """The sliding window ``W`` if *every* layer attends only to its last ``W`` keys, else None.

    Reads ``sliding_window``, ``use_sliding_window`` (Qwen2-style switch) and ``layer_types``
    (models that mix full and sliding layers keep every block: a full layer reads them all).
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "sliding_attention" for t in layer_types):
        return None
    return int(window)
