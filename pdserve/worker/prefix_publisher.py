"""Keeps this instance's set in the prefix index (:mod:`pdserve.scheduler.prefix_index`) equal to
what its prefix cache holds, so routers can send a prompt where its prefix is cached.

The engine loop wakes the publisher after every step; it then writes what the cache gained and
lost since the last write, in one pipeline (so a busy instance writes at most once per step and an
idle one not at all). Every third of the TTL it renews the set's expiry. Whenever the set may have
diverged (the first write, a failed write, the set found missing after a Redis restart) it
replaces the set in full. A failure is logged and retried with backoff, never fatal: the index is
a hint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdserve.errors import ControlPlaneError
from pdserve.scheduler import PrefixIndex
from pdserve.worker.engine_client import EngineClient

log = logging.getLogger(__name__)


class PrefixPublisher:
    def __init__(self, index: PrefixIndex, instance_id: str, engine: EngineClient) -> None:
        self.index = index
        self.instance_id = instance_id
        self.engine = engine
        self.wake = asyncio.Event()
        self.wake.set()  # the first write at once: it replaces whatever a previous run left
        self.synced = False  # the set equals the cache as of the last take of changes
        self.refresh_s = index.ttl_ms / 3000

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
        """One write: the changes since the last one, a full replacement, or a renewed expiry."""
        if not self.synced:
            hashes = await self.engine.prefix_hashes()
            await self.index.replace(self.instance_id, hashes)
            self.synced = True
            log.debug("prefix index of %s replaced: %d blocks", self.instance_id, len(hashes))
            return
        changes = self.engine.take_prefix_changes()
        if changes:
            existed = await self.index.apply(self.instance_id, changes)
        else:
            existed = await self.index.refresh(self.instance_id) or self.engine.load.cached_blocks == 0
        if not existed:  # Redis lost the set (a restart): what it held before the changes is gone
            self.synced = False
            self.wake.set()

    async def remove(self) -> None:
        """Delete the set (a clean stop: routers stop counting on this cache at once)."""
        try:
            await self.index.remove(self.instance_id)
        except ControlPlaneError as e:
            log.warning(
                "could not remove the prefix index of %s (it expires by itself): %s", self.instance_id, e
            )
