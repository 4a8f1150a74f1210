"""Block hashes: the identity of a full KV block, shared by engine, gateway and directory.

A block's hash covers its parent's hash, its token ids and extra keys (the tenant's cache
scope salt), so two blocks hash equal only if their whole prefixes are equal *and* they were
produced under the same cache scope::

    tokens:  [t0 .. t15] [t16 .. t31] [t32 .. t40]   (block_size 16)
    hashes:   h0=H(None, b0, salt)  h1=H(h0, b1, salt)   (partial block: no hash)

Digests are 128-bit BLAKE2b, so collisions are not a practical concern.
"""

from __future__ import annotations

import hashlib
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


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                       start: int = 0, parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    Args:
        token_ids: the whole token sequence.
        block_size: tokens per block.
        salt: cache-scope salt.
        start: first block index to hash; ``parent`` must then be block ``start - 1``'s hash.
        parent: hash of block ``start - 1`` (None when ``start == 0``).
    Returns:
        One hash per full block in ``[start, len(token_ids) // block_size)``.
    """
    hashes: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes
