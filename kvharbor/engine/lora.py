"""LoRA adapters served beside the base model, many in one batch (multi-LoRA).

An adapter is a PEFT checkpoint directory (``adapter_config.json`` and
``adapter_model.safetensors``, what ``peft``'s ``save_pretrained`` writes). For each targeted
projection ``W`` it holds ``A`` ``[r, in]`` and ``B`` ``[out, r]``; a request that names the
adapter computes ``W x + (alpha / r) * B (A x)`` at that projection (``alpha / sqrt(r)`` with
``use_rslora``), which is PEFT's forward. The base weights are never changed, so requests of
different adapters and of the base model share one step: each adapter's rows of a projection's
output get their delta (``index_add_`` over the rows of that adapter; the whole output, no
index, when one adapter has every row). vLLM does the same per-row gather with its punica
kernels.

Supported: the projections of kvharbor's model path (``q_proj`` ``k_proj`` ``v_proj``
``o_proj`` ``gate_proj`` ``up_proj`` ``down_proj``), any subset of layers, per-module ranks
read from the tensors. Refused with the reason: DoRA, trained biases, ``modules_to_save``,
other target modules (embeddings, the LM head), per-module alphas (``alpha_pattern``).

An adapter's KV differs from the base model's for the same tokens, so its requests hash their
blocks in a scope of their own (:func:`.hashing.adapter_salt`): they share prefixes with requests of
the same adapter only.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight ('.default' before .weight
# in checkpoints saved with the adapter's name in the keys)
_KEY = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: generate with the adapter at ``lora_path`` under ``lora_name``
    (``lora_int_id`` is accepted for vLLM's signature; kvharbor keys adapters by name)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


class LoRAAdapter:
    """One loaded adapter: per layer, per target, ``(A^T [in, r], (scale * B)^T [r, out])``."""

    __slots__ = ("name", "path", "rank", "layers")

    def __init__(self, name: str, path: str, rank: int, layers: list[dict]) -> None:
        self.name, self.path, self.rank, self.layers = name, path, rank, layers

    @classmethod
    def load(cls, name: str, path: str | Path, model, max_rank: int) -> "LoRAAdapter":
        """Read the PEFT checkpoint at ``path`` for ``model`` (a transformers causal LM).

        Raises:
            ValueError: the directory is not a LoRA checkpoint this path serves, or it does
                not fit ``model`` (layers, shapes) or ``max_rank``.
        """
        from safetensors.torch import load_file  # noqa: PLC0415 - with transformers anyway

        root = Path(path)
        try:
            config = json.loads((root / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"LoRA adapter {name!r}: no readable adapter_config.json in {str(root)!r} ({e})") from None
        _check_config(name, config)
        weights = root / "adapter_model.safetensors"
        if not weights.is_file():
            raise ValueError(f"LoRA adapter {name!r}: {str(weights)!r} is missing "
                             "(adapters are read from safetensors, as PEFT saves them)")
        try:
            tensors = load_file(str(weights))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"LoRA adapter {name!r}: cannot read {str(weights)!r} ({e})") from None
        inner = model.model
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            m = _KEY.search(key)
            if m is None or m.group(2) not in TARGETS:
                raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of "
                                 f"a projection kvharbor adapts ({', '.join(TARGETS)})")
            pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value
        # a config without lora_alpha gets PEFT's default (LoraConfig.lora_alpha = 8), as PEFT loads it
        alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
        layers: list[dict] = [{} for _ in inner.layers]
        rank = 0
        ref = next(iter(model.parameters()))
        for (i, target), ab in sorted(pairs.items()):
            if i >= len(layers) or set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {name!r}: layer {i} {target} has "
                                 f"{'no such layer in the model' if i >= len(layers) else 'only lora_' + ''.join(ab)}")
            base = _module(inner.layers[i], target)
            a, b = ab["A"], ab["B"]
            r = a.shape[0]
            if a.shape != (r, base.in_features) or b.shape != (base.out_features, r):
                raise ValueError(f"LoRA adapter {name!r}: layer {i} {target} has A {tuple(a.shape)} and "
                                 f"B {tuple(b.shape)}; the model's {target} is {base.in_features} -> "
                                 f"{base.out_features} (an adapter of another model?)")
            if r > max_rank:
                raise ValueError(f"LoRA adapter {name!r}: rank {r} at layer {i} {target} exceeds "
                                 f"max_lora_rank={max_rank}")
            rank = max(rank, r)
            scale = alpha / (math.sqrt(r) if rslora else r)
            a_t = a.to(device=ref.device, dtype=ref.dtype).t().contiguous()
            b_t = (b.to(device=ref.device, dtype=torch.float32) * scale).to(ref.dtype).t().contiguous()
            layers[i][target] = (a_t, b_t)
        if not rank:
            raise ValueError(f"LoRA adapter {name!r}: {str(weights)!r} holds no LoRA weights")
        return cls(name, os.path.normpath(root), rank, layers)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def _check_config(name: str, config: dict) -> None:
    refuse = []
    if config.get("peft_type", "LORA") != "LORA":
        refuse.append(f"peft_type {config.get('peft_type')!r} (LoRA only)")
    if config.get("use_dora"):
        refuse.append("use_dora (DoRA)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        refuse.append("trained biases (bias must be 'none')")
    if config.get("modules_to_save"):
        refuse.append(f"modules_to_save {config['modules_to_save']}")
    if config.get("alpha_pattern"):
        refuse.append("alpha_pattern (per-module alphas)")
    if config.get("fan_in_fan_out"):
        refuse.append("fan_in_fan_out")
    if refuse:
        raise ValueError(f"LoRA adapter {name!r} uses what kvharbor does not serve: {'; '.join(refuse)}")


def _module(layer, target: str):
    return getattr(layer.self_attn if target in TARGETS[:4] else layer.mlp, target)


class LoRAs:
    """The adapters an engine serves, by name. Adding or removing one while steps run is safe:
    a request holds its adapter from ``add_request`` to its end."""

    def __init__(self, model, max_rank: int) -> None:
        self.model, self.max_rank = model, max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self.failed: dict[str, str] = {}        # name -> why its last load failed

    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load ``path`` as ``name`` (again: a no-op for the same path, an error for another)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"a LoRA adapter needs a non-empty name, got {name!r}")
        have = self.adapters.get(name)
        if have is not None:
            if not self.loaded_from(name, path):
                raise ValueError(f"LoRA adapter {name!r} is already loaded from {have.path!r}; "
                                 "load another checkpoint under another name")
            return have
        try:
            adapter = LoRAAdapter.load(name, path, self.model, self.max_rank)
        except ValueError as e:
            self.failed[name] = str(e)
            raise
        self.failed.pop(name, None)
        self.adapters[name] = adapter
        return adapter

    def loaded_from(self, name: str, path: str | Path) -> bool:
        """``name`` is loaded, from ``path``."""
        have = self.adapters.get(name)
        return have is not None and have.path == os.path.normpath(path)

    def remove(self, name: str) -> bool:
        """Stop serving ``name`` (requests running with it finish with it). False if unknown."""
        self.failed.pop(name, None)
        return self.adapters.pop(name, None) is not None

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            if name in self.failed:
                raise ValueError(f"LoRA adapter {name!r} could not be loaded: {self.failed[name]}")
            known = ", ".join(sorted(self.adapters)) or "none loaded"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return adapter


class LoRABatch:
    """One step's rows by adapter: ``full`` for every token row, ``sampled`` for the rows
    the last layer keeps (``logit_rows``); each a list of ``(adapter, rows or None)``."""

    __slots__ = ("full", "sampled")

    def __init__(self, row_adapters: list, logit_rows: list[int], device: torch.device) -> None:
        self.full = _groups(row_adapters, device)
        self.sampled = _groups([row_adapters[r] for r in logit_rows], device)

    def hook(self, layer: int, sampled: bool = False):
        """``hook(target, x, y)`` of ``layer``: :meth:`apply` over ``full`` or ``sampled``."""
        groups = self.sampled if sampled else self.full
        return lambda target, x, y: self.apply(groups, layer, target, x, y)

    @staticmethod
    def apply(groups: list, layer: int, target: str, x: torch.Tensor,
              y: torch.Tensor) -> torch.Tensor:
        """``y`` (the projection of ``x``) with each adapter's delta added to its rows, in place."""
        for adapter, rows in groups:
            w = adapter.layers[layer].get(target)
            if w is None:
                continue
            a_t, b_t = w
            if rows is None:
                y.add_(x @ a_t @ b_t)
            else:
                y.index_add_(0, rows, x.index_select(0, rows) @ a_t @ b_t)
        return y


def _groups(row_adapters: list, device: torch.device) -> list:
    """``[(adapter, rows)]`` for the adapters among ``row_adapters`` (None: base rows);
    ``rows`` None where one adapter has every row."""
    by: dict[LoRAAdapter, list[int]] = {}
    for i, adapter in enumerate(row_adapters):
        if adapter is not None:
            by.setdefault(adapter, []).append(i)
    if len(by) == 1 and len(next(iter(by.values()))) == len(row_adapters):
        return [(next(iter(by)), None)]
    return [(adapter, torch.tensor(rows, dtype=torch.int64, device=device)) for adapter, rows in by.items()]
