"""An instance's running loops: the inbox loop hands each message to the request handler, the engine
loop steps the engine and hands its outputs over (messages first), the housekeeping loop runs the
timers, prunes the KV writers of peers that left, renews the tokenizer and ends a drain at its
deadline. :class:`~pdserve.worker.service.WorkerService` starts them and stops when one dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdserve.errors import ControlPlaneError
from pdserve.scheduler import Inbox
from pdserve.worker.clock import Clock
from pdserve.worker.engine_client import EngineClient
from pdserve.worker.handler import RequestHandler
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.prefix_publisher import PrefixPublisher
from pdserve.worker.presence import TOKENIZER_REFRESH_S, Presence

log = logging.getLogger("pdserve.worker.service")

# Longest the engine loop holds its next step back while messages are acted on (the inbox's current
# batch, a prepared request's hand-over: milliseconds, preparation never counts; this bounds a stall
# when Redis is slow to take replies).
INBOX_FIRST_S = 0.25
PRUNE_WRITERS_S = 1.0  # how often the KV writers of peers that left (or restarted) are closed


class Loops(Presence):
    """The loops of :class:`~pdserve.worker.service.WorkerService` (which builds what they use)."""

    clock: Clock
    inbox: Inbox
    metrics: WorkerMetrics | None
    prefix_publisher: PrefixPublisher | None
    _drain_deadline: float
    _wake: asyncio.Event
    _stop: asyncio.Event

    # ---- loops -----------------------------------------------------------------------------------
    def _running(self) -> tuple[EngineClient, RequestHandler]:
        """The engine and the request handler: run() builds both before any loop starts."""
        assert self.engine is not None and self.handler is not None
        return self.engine, self.handler

    async def _inbox_loop(self) -> None:
        _, handler = self._running()
        failures = 0
        while True:
            await handler.room()  # no more reading while many messages are still handled as tasks
            try:
                entries = await self.inbox.read(count=64, block_ms=500)
                failures = 0
                if entries and self.metrics is not None:
                    self.metrics.on_inbox_read([entry_id for entry_id, _ in entries])
            except ControlPlaneError as e:
                failures += 1
                handler.control_plane_failed()
                log.warning("reading the inbox failed (%s); retry %d", e, failures)
                await asyncio.sleep(min(0.1 * 2**failures, 2.0))
                continue
            with handler.acting():  # preparations go on as tasks (handler.dispatch)
                for _entry_id, msg in entries:
                    try:
                        await handler.dispatch(msg)
                    except Exception:
                        log.exception("handling %s for %s failed", msg.type, msg.request_id)
            if entries:
                try:
                    await self.inbox.ack([entry_id for entry_id, _ in entries])
                except ControlPlaneError as e:  # they stay pending: a restart re-reads them
                    log.warning("acking %d inbox entries failed: %s", len(entries), e)
                self._wake.set()

    async def _engine_loop(self) -> None:
        engine, handler = self._running()
        while True:
            if not engine.unfinished:
                self._wake.clear()
                if handler.draining and not handler.in_flight():
                    self._stop.set()
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                continue
            if not handler.idle.is_set():
                # Messages first: each one that needs the engine (a reserve, a prepared generate, a
                # prefilled hand-off) would otherwise wait for a whole step, one step per message, and
                # a busy prefill's 512-token steps made a batch of reserves miss their deadline. Never
                # a preparation: a large schema compiles for seconds (handler.dispatch).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(handler.idle.wait(), timeout=INBOX_FIRST_S)
            await handler.on_outputs(await engine.step())
            if self.prefix_publisher is not None:
                self.prefix_publisher.wake.set()

    async def _housekeeping_loop(self) -> None:
        _, handler = self._running()
        pruned_at = tokenizer_at = self.clock.monotonic()
        while True:
            await asyncio.sleep(0.1)
            try:
                await handler.tick()
                if self.clock.monotonic() - pruned_at >= PRUNE_WRITERS_S:
                    pruned_at = self.clock.monotonic()
                    await self._prune_writers()
                if self.clock.monotonic() - tokenizer_at >= TOKENIZER_REFRESH_S:
                    tokenizer_at = self.clock.monotonic()
                    await self._renew_tokenizer()
            except ControlPlaneError as e:
                log.warning("housekeeping: %s", e)
            if handler.draining and self.clock.monotonic() > self._drain_deadline:
                log.warning("drain timeout: failing %d requests still in flight", handler.in_flight())
                self._stop.set()

    async def _prune_writers(self) -> None:
        """Close the KV writers of peers no longer registered (or restarted), so that a dead
        decode instance's cache is not kept mapped here (it would hold /dev/shm's memory)."""
        peers = self.transports.peers
        alive = await self.registry.alive(peers) if peers else set()
        self.transports.prune([p for p in peers if p not in alive])
