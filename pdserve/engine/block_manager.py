"""KV block allocator with a prefix cache: free list, reference counts, and full blocks kept by
their chain hash (:mod:`pdserve.block_hash`) after their last user frees them, so a later request
with the same prefix reuses them. Pure Python, no tensor library.

A block is in one of three states: in use (references > 0), cached (no references, holds a
registered hash: reusable, evicted least recently freed first when blocks run short), or free.
A shared block is never written: only full blocks are registered, and a sequence writes only past
the blocks it took from the cache.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

NULL_BLOCK = 0  # an all-zero block for padding block tables; never handed out


class BlockManager:
    """Hands out block ids of the cache; block 0 (the null block) is never handed out."""

    def __init__(self, num_blocks: int, prefix_caching: bool = False) -> None:
        """``prefix_caching``: keep registered blocks (the engine's setting decides; off here, so
        tests of plain allocation see plain allocation)."""
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # registered blocks
        self._block_of: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks, LRU first
        self.num_evicted = 0
        self._changes: dict[bytes, bool] | None = None  # hash -> held, since the last take_changes()
        self.on_evict: Callable[[int, bytes], None] | None = None
        """Called with (block, hash) as a cached block is evicted, before it is handed out: its bytes
        are still the cached K/V (the engine's host tier copies them)."""

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def capacity(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    def can_allocate(self, n: int, reused: list[int] | None = None) -> bool:
        """``n`` new blocks fit, besides the cached blocks ``reused`` (taken from the cache)."""
        taken = sum(1 for b in reused or () if b in self._cached)
        return n <= self.num_free - taken

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:  # evict the least recently freed cached block
                b, _ = self._cached.popitem(last=False)
                evicted = self._hash_of.pop(b)
                if self.on_evict is not None:
                    self.on_evict(b, evicted)
                del self._block_of[evicted]
                self.num_evicted += 1
                if self._changes is not None:
                    self._changes[evicted] = False
            self._refs[b] = 1
            out.append(b)
        return out

    def share(self, blocks: list[int]) -> None:
        """Add a reference to blocks already allocated or cached (a shared prefix)."""
        for b in blocks:
            if self._refs[b] == 0:
                if b not in self._cached:
                    raise ValueError(f"block {b} is not allocated")
                del self._cached[b]
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._cached[b] = None  # most recently freed last
                else:
                    self._free.append(b)

    # ---- the prefix cache -----------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest prefix of ``hashes`` (in order; empty when caching is off)."""
        out: list[int] = []
        if not self.prefix_caching:
            return out
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def register(self, block: int, block_hash: bytes) -> None:
        """``block`` (in use, full, its K/V computed) holds the prefix ``block_hash`` names. A hash
        another block already holds keeps that block (the first copy serves later requests)."""
        if not self.prefix_caching or block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        if self._changes is not None:
            self._changes[block_hash] = True

    def take_changes(self) -> dict[bytes, bool]:
        """What the cache gained (True) and lost (False) since the last call, by hash (a hash
        gained and lost in between appears once, as its last state). The first call starts the
        record: until someone asks, nothing is kept."""
        changes, self._changes = self._changes or {}, {}
        return changes

    def hashes(self) -> list[bytes]:
        """Every hash the cache holds now (for a full re-publication of the index)."""
        return list(self._block_of)
