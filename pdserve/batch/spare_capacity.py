"""When a batch worker may send a line: only in the capacity online requests leave, and only while
Redis has room for the line's outcome above the part of its memory kept for serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from pdserve.router.http.state import RouterState
from pdserve.scheduler.redis_server import memory_room
from pdserve.scheduler.registration import InstanceInfo

logger = logging.getLogger(__name__)

CAPACITY_POLL_S = 0.05
ROOM_CHECK_S = 1.0
"""How long one reading of Redis's memory room (:class:`MemoryRoom`) holds for a batch's lines."""


class SpareCapacity:
    """Admits a line only while some instance of its model has room: fewer sequences (running and
    queued) than ``max_load`` × its ``max_num_seqs``, so online arrivals always find free slots; and
    at most ``concurrency`` lines at once, ``busy_concurrency`` while some instance of the model
    serves online requests (its load minus its batch lines). Online requests are never gated (they
    go through the online routers), and the instances run the lines as background work: prefilled
    only in steps no online prompt needs, preempted first."""

    def __init__(self, state: RouterState, max_load: float, concurrency: int, busy_concurrency: int) -> None:
        self.state = state
        self.max_load = max_load
        self.concurrency = concurrency
        self.busy_concurrency = busy_concurrency
        self.in_flight = 0
        self._waiters = asyncio.Semaphore(concurrency)  # lines past it wait without polling anything
        self._room: dict[str, tuple[float, bool]] = {}
        """By the key it was read for: when Redis's memory room was read, and whether it was full."""

    def limit(self, live: list[InstanceInfo], model: str) -> int:
        """How many lines may be in flight now (0: no instance has room)."""
        room = {"prefill": False, "decode": False, "mixed": False}
        busy = False
        for info in live:
            if info.model != model or info.draining:
                continue
            held = info.load.running + info.load.waiting
            busy = busy or held > info.load.background
            if not info.max_num_seqs or held < max(1.0, self.max_load * info.max_num_seqs):
                room[info.role] = True
        if not (room["mixed"] or (room["prefill"] and room["decode"])):
            return 0
        return self.busy_concurrency if busy else self.concurrency

    async def has_room(self, key: str) -> bool:
        """Whether the Redis server holding ``key`` (a batch's outcomes) takes more batch data
        without going into its serving reserve (:class:`MemoryRoom`); read at most every
        ROOM_CHECK_S per key. Lines wait while it does not: their outcomes would crowd out serving."""
        now = time.monotonic()
        read_at, full = self._room.get(key, (-ROOM_CHECK_S, False))
        if now - read_at >= ROOM_CHECK_S:
            room = await memory_room(self.state.dispatcher.redis, key)
            was_full, full = full, room is not None and room.room <= 0
            if len(self._room) >= 256:  # keys of batches long gone
                self._room.clear()
            self._room[key] = (now, full)
            if room is not None and full and not was_full:
                logger.warning("batch lines wait: %s", room.refuse("sending more lines"))
            elif was_full and not full:
                logger.info("batch lines go on: Redis has room above its serving reserve again")
        return not full

    @contextlib.asynccontextmanager
    async def admit(
        self, model: str, stopped: Callable[[], Awaitable[bool]], room_key: str
    ) -> AsyncIterator[bool]:
        """Wait for a slot within the limit while Redis has room for the outcome (the server
        holding ``room_key``); yields False when ``stopped()`` turned true meanwhile."""
        async with self._waiters:
            while not await stopped():
                live = await self.state.dispatcher.live.get()
                if self.in_flight < self.limit(live, model) and await self.has_room(room_key):
                    self.in_flight += 1
                    try:
                        yield True
                    finally:
                        self.in_flight -= 1
                    return
                await asyncio.sleep(CAPACITY_POLL_S)
            yield False
