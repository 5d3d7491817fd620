"""Keeps this instance's sets in the prefix index (:mod:`pdserve.scheduler.prefix_index`) equal to
what its prefix cache holds (the ``pool`` set) and, with a host tier, what that tier holds (the
``host`` set), so routers can send a prompt where its prefix is cached. With a disk tier it also
writes what it stored and removed there into that tier's set, which the instances sharing the
tier's directory write together (``disk_tier_id``), and replaces that set from its listing of the
directory at start.

The engine loop wakes the publisher after every step; it then writes what the cache gained and
lost since the last write, in one pipeline (so a busy instance writes at most once per step and an
idle one not at all). A write renews the set's expiry; a set with nothing to write has it renewed
when its last renewal is a sixth of the TTL old (the idle publisher wakes every third), not after
every step: that call per decoded token was a third of the worker's event-loop CPU at batch 1. Whenever the set may have
diverged (the first write, a failed write, the set found missing after a Redis restart) it
replaces the set in full. A failure is logged and retried with backoff, never fatal: the index is
a hint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from pdserve.errors import ControlPlaneError
from pdserve.scheduler import PrefixIndex
from pdserve.worker.engine_client import EngineClient

log = logging.getLogger(__name__)


class PrefixPublisher:
    def __init__(
        self, index: PrefixIndex, instance_id: str, engine: EngineClient, disk_tier_id: str | None = None
    ) -> None:
        self.index = index
        self.instance_id = instance_id
        self.engine = engine
        self.disk_tier_id = disk_tier_id
        tiers = ["pool", "host"] if engine.facts.host_tier else ["pool"]
        self.tiers = (*tiers, "disk") if disk_tier_id else tuple(tiers)
        self.wake = asyncio.Event()
        self.wake.set()  # the first write at once: it replaces whatever a previous run left
        self.synced = False  # the set equals the cache as of the last take of changes
        self.refresh_s = index.ttl_ms / 3000
        self._renewed: dict[str, float] = {}  # tier -> monotonic time of its set's last write

    async def run(self) -> None:
        failures = 0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=self.refresh_s)
            self.wake.clear()
            try:
                await self.publish()
                failures = 0
            except ControlPlaneError as e:
                self.synced = False
                failures += 1
                log.warning("prefix index: %s; replacing it in full at the next try (%d)", e, failures)
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))

    async def publish(self) -> None:
        """One write per tier: the changes since the last one, a full replacement, or a renewed expiry."""
        if not self.synced:
            for tier in self.tiers:
                hashes = await self.engine.prefix_hashes(tier)
                if tier == "disk":
                    assert self.disk_tier_id is not None
                    await self.index.replace_disk(self.disk_tier_id, hashes, self.instance_id)
                    continue
                await self.index.replace(self.instance_id, hashes, tier)
                log.debug("prefix index of %s (%s) replaced: %d blocks", self.instance_id, tier, len(hashes))
            self.synced = True
            self._renewed = dict.fromkeys(self.tiers, time.monotonic())
            return
        for tier in self.tiers:
            changes = self.engine.take_prefix_changes(tier)
            now = time.monotonic()
            if not changes and now - self._renewed.get(tier, -math.inf) < self.refresh_s / 2:
                continue  # nothing to write, and the expiry is fresh enough
            self._renewed[tier] = now
            if tier == "disk":
                existed = await self._publish_disk(changes)
            elif changes:
                existed = await self.index.apply(self.instance_id, changes, tier)
            else:
                existed = await self.index.refresh(self.instance_id, tier) or self._held(tier) == 0
            if not existed:  # Redis lost the set (a restart): what it held before the changes is gone
                self.synced = False
                self.wake.set()

    async def _publish_disk(self, changes: dict[bytes, bool]) -> bool:
        """The disk tier's changes this instance made, or a renewed expiry (the set lives while any
        instance sharing the tier does); False when the set was gone (replace it)."""
        assert self.disk_tier_id is not None
        if changes:
            return await self.index.apply_disk(self.disk_tier_id, changes)
        return await self.index.refresh_disk(self.disk_tier_id) or self._held("disk") == 0

    def _held(self, tier: str) -> int:
        """Blocks the tier holds as of the engine's last load snapshot."""
        load = self.engine.load
        if tier == "pool":
            return load.cached_blocks
        if tier == "disk":
            return load.disk.blocks if load.disk is not None else 0
        return load.tier.blocks if load.tier is not None else 0

    async def remove(self) -> None:
        """Delete the set (a clean stop: routers stop counting on this cache at once)."""
        try:
            await self.index.remove(self.instance_id)
        except ControlPlaneError as e:
            log.warning(
                "could not remove the prefix index of %s (it expires by itself): %s", self.instance_id, e
            )
