"""Block hashes: the identity of a full KV block, shared by engine, gateway and directory.

A block's hash covers its parent's hash, its token ids and extra keys (the tenant's cache
scope salt), so two blocks hash equal only if their whole prefixes are equal *and* they were
produced under the same cache scope::

    tokens:  [t0 .. t15] [t16 .. t31] [t32 .. t40]   (block_size 16)
    hashes:   h0=H(root, b0, salt)  h1=H(h0, b1, salt)   (partial block: no hash)

The chain's root is ``model_root(model_identity)``: the model's name plus a digest of its config
and weights (``model_identity.py``), so blocks of another model, or of the same name with other
weights, never hash equal. The engine, the gateway and the directory all start chains there.

Digests are 128-bit BLAKE2b, so collisions are not a practical concern.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

_DIGEST_BYTES = 16


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    """Hash one full block.

    Args:
        parent: hash of the previous block, or None for the first block.
        token_ids: exactly the block's token ids.
        salt: cache-scope salt; None means the public scope.
    Returns:
        A 16-byte digest.
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(parent or b"\x00" * _DIGEST_BYTES)
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"\x01salt:" + salt.encode())
    return BlockHash(h.digest())


def model_root(identity: str | None) -> BlockHash | None:
    """The root of every hash chain of the model ``identity`` (None: no model identity, the
    all-zero root; only for tests and tools that do not compare with an engine)."""
    if identity is None:
        return None
    return BlockHash(hashlib.blake2b(b"\x02model:" + identity.encode(), digest_size=_DIGEST_BYTES).digest())


def with_request_salt(salt: str | None, request_salt: str | None) -> str | None:
    """The cache-scope salt of a request that sends its own ``cache_salt`` (vLLM's request
    field) in scope ``salt``: its blocks are reused only by requests of that scope sending the
    same string. The string enters as a digest, so none can spell another scope's or an
    adapter's salt."""
    if request_salt is None:
        return salt
    return f"{salt or ''}|request:{hashlib.blake2b(request_salt.encode(), digest_size=16).hexdigest()}"


def adapter_salt(salt: str | None, adapter: str | None, path: str = "") -> str | None:
    """The cache-scope salt of a request of LoRA ``adapter`` loaded from ``path`` (None: the
    base model) in scope ``salt``: an adapter's KV differs from the base model's for the same
    tokens, and from the KV of another checkpoint under the same name. The gateway (the
    router's hashes) and the engine both hash with it."""
    return salt if adapter is None else f"{salt or ''}|lora:{adapter}@{os.path.normpath(path)}"


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                       start: int = 0, parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    Args:
        token_ids: the whole token sequence.
        block_size: tokens per block.
        salt: cache-scope salt.
        start: first block index to hash; ``parent`` must then be block ``start - 1``'s hash.
        parent: hash of block ``start - 1``; when ``start == 0``, the chain's root
            (``model_root(identity)``; None: the all-zero root).
    Returns:
        One hash per full block in ``[start, len(token_ids) // block_size)``.
    """
    hashes: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes
