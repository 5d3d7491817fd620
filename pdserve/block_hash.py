"""The identity of a full KV block: a chain hash of the token ids up to and including it.

Shared by the engine (its prefix cache) and the router (prefix routing): the same prompt
gives the same hashes in every process and on every machine, so no Python ``hash()`` (seeded per
process) and nothing random. ``blake2b`` of 16 bytes over the parent's hash, the block's token ids
as little-endian int32 and the extra key (a cache salt, say), which only the first block takes:
later blocks inherit it through the chain.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

HASH_BYTES = 16


def salt_key(salt: str | None) -> bytes:
    """The extra key of a request's hashes: its ``cache_salt`` (none: empty)."""
    return salt.encode() if salt else b""


def block_hash(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """The hash of a block holding ``token_ids`` after the blocks whose last hash is ``parent``."""
    ids = array("i", token_ids)  # int32 on every platform CPython runs on
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent if parent is not None else b"\0" * HASH_BYTES)
    if parent is None:
        h.update(len(extra).to_bytes(4, "little") + extra)
    h.update(ids.tobytes())
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int], block_size: int, extra: bytes = b"", start: int = 0, parent: bytes | None = None
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` from block ``start`` on (``parent``: the hash of
    block ``start - 1``)."""
    out: list[bytes] = []
    for i in range(start, len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out
