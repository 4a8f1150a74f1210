"""Model identity: the name plus a digest of the model's config and weights.

The identity is the root of every block-hash chain (``hashing.model_root``), so KV computed by
one model is never reused for another, even one served under the same name: change a weight
file or a config field and every hash changes, in the engine, the host tier, the prefix
directory and the routers alike.

It is computed from the model's *source*, without loading the weights, so the gateway (which
loads only the tokenizer) computes the same identity as the replicas and its routing hashes
match theirs:

* builtin models: the config fields kvharbor sets and the transformers version (which sets
  every other field's default), plus the digest of the packaged weights file when there is
  one, else the seed and the torch version that generate the random weights. Read from
  ``model_info`` and the installed packages' metadata, without importing torch or
  transformers (the gateway computes it at start);
* a local checkpoint directory: ``config.json`` plus every weight file (name and content);
* a hub id: the same over the locally cached snapshot when ``huggingface_hub`` finds one;
  otherwise the config alone (then a changed upload needs a new name or ``POST /admin/cache/flush``).

File digests are cached by (path, size, mtime), so a process hashes each file once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from importlib.metadata import version as package_version
from pathlib import Path

from .model_info import BUILTIN_SPECS, TRAINED_WEIGHTS

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """SHA-256 of one file (``size`` and ``mtime_ns`` key the cache, so a rewrite is re-hashed)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digest(path: Path) -> str:
    st = path.stat()
    return _file_digest(str(path), st.st_size, st.st_mtime_ns)


def _directory_parts(directory: Path) -> list[str]:
    """Digest parts of a checkpoint directory: config.json and every weight file, sorted by name."""
    parts = []
    for p in sorted(directory.rglob("*")):
        if p.is_file() and (p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES)):
            parts.append(f"{p.relative_to(directory)}:{file_digest(p)}")
    return parts


def _hub_snapshot(name: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not installed, not cached, not a repo id: no snapshot
        return None


def _builtin_parts(name: str, seed: int) -> list[str]:
    kind, fields = BUILTIN_SPECS[name]
    parts = ["builtin:" + json.dumps([kind, fields], sort_keys=True),
             f"transformers={package_version('transformers')}"]
    weights = TRAINED_WEIGHTS.get(name)
    if weights is not None and weights.is_file():
        parts.append("weights:" + file_digest(weights))
    else:
        parts.append(f"random:seed={seed}:torch={package_version('torch')}")
    return parts


def _source_parts(name: str, seed: int) -> list[str]:
    if name in BUILTIN_SPECS:
        return _builtin_parts(name, seed)
    directory = Path(name) if os.path.isdir(name) else _hub_snapshot(name)
    if directory is not None:
        return _directory_parts(directory)
    from transformers import AutoConfig  # noqa: PLC0415

    return ["config:" + AutoConfig.from_pretrained(name).to_json_string(use_diff=False)]


def model_identity(name: str, seed: int = 0) -> str:
    """``"<name>@<32 hex>"``: the model's name and a digest of its config and weights.

    Deterministic for the same files (or, for random builtin weights, the same seed and
    library versions); any change to them changes it.
    """
    h = hashlib.blake2b(digest_size=16)
    for part in _source_parts(name, seed):
        h.update(part.encode() + b"\x00")
    return f"{name}@{h.hexdigest()}"
