"""How many requests one router runs at once: beyond ``limit`` they wait in a bounded queue, and
beyond that they are refused at once with 429 (``Retry-After``), so overload is an answer."""

from __future__ import annotations

import asyncio

from pdserve.errors import RequestTimeoutError
from pdserve.router.errors import OverloadedError


class Admission:
    """``limit`` 0: unlimited. ``queue``: how many may wait for a slot, up to ``wait_s`` each."""

    def __init__(self, limit: int, queue: int, wait_s: float) -> None:
        self.limit = limit
        self.queue = queue
        self.wait_s = wait_s
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None
        self.waiting = 0

    async def enter(self) -> None:
        if self._slots is None:
            return
        if self._slots.locked():
            if self.waiting >= self.queue:
                raise OverloadedError(self.limit, self.queue)
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self.wait_s)
            except TimeoutError:
                raise RequestTimeoutError(
                    f"waited {self.wait_s:.0f} s for one of this router's slots"
                ) from None
            finally:
                self.waiting -= 1
            return
        await self._slots.acquire()

    def leave(self) -> None:
        if self._slots is not None:
            self._slots.release()
