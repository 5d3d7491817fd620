"""KV block allocator: free list plus reference counts. Pure Python, no tensor library."""

from __future__ import annotations

from collections import deque

NULL_BLOCK = 0  # an all-zero block for padding block tables; never handed out


class BlockManager:
    """Hands out block ids of the cache; block 0 (the null block) is never handed out."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """Add a reference to blocks already allocated (e.g. a shared prefix)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
