"""The engine's side of the KV tiers below its block pool, as ``LLMEngine`` methods (it inherits
:class:`TieredCache`): building the host tier (``--kv-host-bytes``) and the disk tier
(``--kv-disk-path``, ``--kv-disk-bytes``), sending a block the pool evicts one tier down, and the
block hashes each tier gained or lost (the worker publishes them for prefix-aware routing). The
read-back of a prompt's blocks is ``tier_reader.TierReader``, which the batcher calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pdserve.engine.batcher import Batcher
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.executor import EngineCache
from pdserve.engine.tiers.disk_tier import DiskTier
from pdserve.engine.tiers.host_tier import HostTier, TierNamespace
from pdserve.engine.tiers.tier_reader import TierReader

log = logging.getLogger(__name__)


class TieredCache:
    """``LLMEngine``'s tier methods; the attributes are the engine's (set by its ``__init__``)."""

    weights_digest: str
    cache: EngineCache
    blocks: BlockManager
    batcher: Batcher
    host_tier: HostTier | None
    disk_tier: DiskTier | None
    tier_reader: TierReader | None

    def _tiers(self, config: EngineConfig, ex: Any) -> None:
        """The tiers below the pool: the host tier (``--kv-host-bytes``), then the disk tier
        (``--kv-disk-path``, ``--kv-disk-bytes``); an eviction goes one tier down, a read-back
        comes from the highest tier holding the block."""
        namespace = TierNamespace(
            weights_digest=self.weights_digest,
            weights=ex.weights,
            dtype=ex.dtype,
            layout="block_major",
            block_size=config.block_size,
            block_bytes=self.cache.block_bytes,
        )
        if config.kv_host_bytes:
            self.host_tier = HostTier(config.kv_host_bytes, namespace)
            log.info(
                "host tier: %.1f MiB, %d blocks", config.kv_host_bytes / 2**20, self.host_tier.max_blocks
            )
        if config.kv_disk_path and config.kv_disk_bytes:
            self.disk_tier = DiskTier(config.kv_disk_path, config.kv_disk_bytes, namespace)
            log.info(
                "disk tier: %s, %.1f MiB, %d blocks (%d found)",
                self.disk_tier.dir,
                config.kv_disk_bytes / 2**20,
                self.disk_tier.max_files,
                self.disk_tier.num_blocks,
            )
            if self.host_tier is not None:
                self.host_tier.on_evict = self.disk_tier.put
        elif config.kv_disk_path or config.kv_disk_bytes:
            log.warning("the disk tier needs both --kv-disk-path and --kv-disk-bytes: it is off")
        if self.host_tier is not None or self.disk_tier is not None:
            self.blocks.on_evict = self._evicted
            self.tier_reader = TierReader(self.host_tier, self.cache.write_blocks, self.disk_tier)
            self.batcher.tier = self.tier_reader

    def _evicted(self, block: int, block_hash: bytes) -> None:
        """The pool evicts a cached block: keep its bytes in the host tier, else the disk tier
        (before its new owner writes it). A failure loses the block from the tiers, never a request."""
        try:
            if self.host_tier is not None and self.host_tier.max_blocks:
                self.host_tier.put(block_hash, self.cache.read_blocks([block]))
            # no host tier (or one too small for a block); a block with a file already is touched,
            # not copied
            elif self.disk_tier is not None and not self.disk_tier.refresh(block_hash):
                self.disk_tier.put(block_hash, self.cache.read_blocks([block]))
        except Exception:
            log.exception("tiers: block %d not stored", block)

    def take_tier_changes(self) -> dict[bytes, bool]:
        """Block hashes the host tier gained (True) or lost (False) since the last call."""
        return self.host_tier.take_changes() if self.host_tier is not None else {}

    def tier_hashes(self) -> list[bytes]:
        """Every block hash the host tier holds; its recorded changes are dropped."""
        if self.host_tier is None:
            return []
        self.host_tier.take_changes()
        return self.host_tier.hashes()

    def take_disk_changes(self) -> dict[bytes, bool]:
        """Block hashes the disk tier gained or lost since the last call (any thread may call it)."""
        return self.disk_tier.take_changes() if self.disk_tier is not None else {}

    def watch_disk(self, callback: Callable[[], None]) -> None:
        """Have the disk tier's writer thread call ``callback`` after it wrote a burst of files (the
        worker wakes its prefix publisher: the writes land after the step that queued them)."""
        if self.disk_tier is not None:
            self.disk_tier.on_change = callback

    def disk_hashes(self) -> list[bytes]:
        """Every block hash the disk tier holds; its recorded changes are dropped (any thread)."""
        return self.disk_tier.take_hashes() if self.disk_tier is not None else []
