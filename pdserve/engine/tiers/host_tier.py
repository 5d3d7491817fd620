"""The host tier: KV blocks evicted from the engine's pool live on in host memory, LRU, bounded in bytes.

When the prefix cache evicts a cached, unreferenced block to reuse its place in the pool, its bytes
are copied here first (the block still holds them: the allocation that evicts it hands the block to
its new owner, who writes it only in a later forward). An admission that misses blocks in the pool
reads the ones found here back into fresh pool blocks instead of recomputing them.

An entry is keyed by what it is: a namespace digest of everything that makes a block's bytes
meaningful (the weights' digest and precision, the KV dtype and layout, the block size and a
block's byte size) and the block's chain hash (:mod:`pdserve.block_hash`), which already carries
the tenant's cache salt (the salt seeds the first block's hash). Each entry keeps an XXH3 digest
of its bytes (:mod:`pdserve.cache_transfer.checksum`, the hand-offs' helper) taken when it was
stored; a read-back checks it first, and a mismatch is a miss (counted, the entry dropped), never
bytes put in the pool.

Per engine (one worker's memory); the tier shared by the instances of a host is the disk tier below
it (:mod:`pdserve.engine.tiers.disk_tier`), which receives what this one evicts (``on_evict``, with the
digest taken at the store: the bytes are checked once, end to end). What the tier gained and lost is recorded (:meth:`HostTier.take_changes`) like the pool's, and the
worker publishes it to the prefix index. Pure numpy; no lock: the engine's thread alone touches it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from pdserve.cache_transfer.checksum import HOST_ALGO, block_digests
from pdserve.engine.outputs import TierLoad


@dataclasses.dataclass(frozen=True)
class TierNamespace:
    """What a block's bytes depend on besides its tokens: two engines with equal namespaces may
    exchange blocks (a shared tier's key); one that differs in any of them must never read them."""

    weights_digest: str
    weights: str  # precision of the linear layers ("f32", "int8", "bf16")
    dtype: str  # the KV cache's element type
    layout: str
    block_size: int
    block_bytes: int

    def digest(self) -> bytes:
        text = "|".join(str(v) for v in dataclasses.astuple(self))
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclasses.dataclass
class TierStats:
    """Counters since the engine started (the registration's ``tier``, ``pdserve status``)."""

    stores: int = 0  # blocks written here (evicted from the pool)
    hits: int = 0  # blocks read back into the pool, checksum verified
    misses: int = 0  # admitted prompts' full blocks that neither the pool nor the tier held
    corrupt: int = 0  # entries whose bytes failed their checksum at a read-back (dropped, recomputed)
    evictions: int = 0  # entries dropped to stay within the byte bound


@dataclasses.dataclass
class _Entry:
    block_hash: bytes
    data: bytes
    digest: bytes


class HostTier:
    """Blocks by key, least recently used first out, at most ``capacity_bytes`` of block bytes."""

    def __init__(self, capacity_bytes: int, namespace: TierNamespace) -> None:
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.max_blocks = capacity_bytes // namespace.block_bytes
        self._ns = namespace.digest()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # key -> entry, LRU first
        self.stats = TierStats()
        self._changes: dict[bytes, bool] | None = None  # block hash -> held, since take_changes()
        # the tier below (the disk tier): told each LRU eviction's hash, bytes and stored digest
        self.on_evict: Callable[[bytes, bytes, bytes], None] | None = None

    def key(self, block_hash: bytes) -> bytes:
        """The entry's key: the namespace and the block's chain hash (which carries the salt)."""
        return hashlib.blake2b(self._ns + block_hash, digest_size=16).digest()

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.block_bytes

    def __contains__(self, block_hash: bytes) -> bool:
        return self.key(block_hash) in self._entries

    def put(self, block_hash: bytes, data: bytes) -> None:
        """Keep one block's bytes (a copy the caller made of the pool's block); the least recently
        used entries go to make room. An entry already held is only marked used (same bytes)."""
        if self.max_blocks == 0:
            return
        if len(data) != self.block_bytes:
            raise ValueError(f"a host-tier block has {self.block_bytes} bytes, got {len(data)}")
        key = self.key(block_hash)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        while len(self._entries) >= self.max_blocks:
            _, old = self._entries.popitem(last=False)
            self.stats.evictions += 1
            self._record(old.block_hash, False)
            if self.on_evict is not None:  # the disk tier below: write-back on eviction
                self.on_evict(old.block_hash, old.data, old.digest)
        digest = block_digests(np.frombuffer(data, dtype=np.uint8), [0], self.block_bytes, HOST_ALGO)
        self._entries[key] = _Entry(block_hash, data, digest)
        self.stats.stores += 1
        self._record(block_hash, True)

    def read(self, hashes: list[bytes]) -> list[bytes]:
        """The bytes of the leading run of ``hashes`` the tier holds, each checked against the
        digest taken when it was stored. The run ends at the first block not held or whose bytes
        no longer match (that entry is dropped and counted as corrupt: never handed out). The
        entries become the most recently used, the first block most (the head of a chain, which
        every longer prompt needs, goes last); the caller holds the bytes, so an eviction from the
        tier after this call (an allocation's own) takes nothing from it."""
        good: list[bytes] = []
        keys: list[bytes] = []
        for h in hashes:
            key = self.key(h)
            entry = self._entries.get(key)
            if entry is None:
                break
            found = block_digests(np.frombuffer(entry.data, dtype=np.uint8), [0], self.block_bytes, HOST_ALGO)
            if found != entry.digest:
                del self._entries[key]
                self.stats.corrupt += 1
                self._record(h, False)
                break
            keys.append(key)
            good.append(entry.data)
        for key in reversed(keys):
            self._entries.move_to_end(key)
        self.stats.hits += len(good)
        return good

    def touch(self, hashes: list[bytes]) -> None:
        """Make the entries of ``hashes`` it holds the most recently used, the first one most."""
        for h in reversed(hashes):
            key = self.key(h)
            if key in self._entries:
                self._entries.move_to_end(key)

    def run(self, hashes: list[bytes]) -> int:
        """How many leading ``hashes`` the tier holds (no counter moves: a plan, not a read)."""
        n = 0
        for h in hashes:
            if self.key(h) not in self._entries:
                break
            n += 1
        return n

    def snapshot(self) -> TierLoad:
        """Size and counters as plain data (the engine's load; the registration's ``tier``)."""
        return TierLoad(
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes,
            blocks=self.num_blocks,
            **dataclasses.asdict(self.stats),
        )

    # ---- what the prefix index is told ----------------------------------------------------------
    def _record(self, block_hash: bytes, held: bool) -> None:
        if self._changes is not None:
            self._changes[block_hash] = held

    def take_changes(self) -> dict[bytes, bool]:
        """Block hashes gained (True) and lost (False) since the last call; the first call starts
        the record (as :meth:`BlockManager.take_changes`)."""
        changes, self._changes = self._changes or {}, {}
        return changes

    def hashes(self) -> list[bytes]:
        """Every block hash the tier holds now."""
        return [e.block_hash for e in self._entries.values()]
