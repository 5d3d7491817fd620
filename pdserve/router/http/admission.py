"""How many choices one router runs at once: beyond ``limit`` requests wait in a bounded queue, and
beyond that they are refused at once with 429 (``Retry-After``), so overload is an answer.

A request costs one slot per choice (prompts x ``n``): each choice is a generation on the cluster,
so a request fanning out to 64 of them must not count as one. ``/tokenize`` and ``/detokenize``
cost one slot each (they run on an instance's engine thread too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from pdserve.errors import InvalidRequestError, RequestTimeoutError
from pdserve.router.api.errors import OverloadedError


class Admission:
    """``limit`` 0: unlimited. ``queue``: how many requests may wait for slots, up to ``wait_s`` each.

    Waiters are served in arrival order (a large request at the head is not starved by small ones).
    """

    def __init__(self, limit: int, queue: int, wait_s: float) -> None:
        self.limit = limit
        self.queue = queue
        self.wait_s = wait_s
        self.in_use = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def enter(self, cost: int = 1, param: str | None = "n") -> None:
        """Take ``cost`` slots, waiting in the queue if need be. A cost above the limit can never be
        admitted: a 400 naming ``param`` (never a 429 a client would retry forever)."""
        if self.limit <= 0:
            return
        if cost > self.limit:
            raise InvalidRequestError(
                f"this router runs at most {self.limit} choices at once (--max-in-flight); "
                f"this request asks for {cost}",
                param,
            )
        if not self._waiters and self.in_use + cost <= self.limit:
            self.in_use += cost
            return
        if len(self._waiters) >= self.queue:
            raise OverloadedError(self.limit, self.queue)
        entry = (cost, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(entry[1], self.wait_s)
        except BaseException as e:
            self._give_up(entry)
            if isinstance(e, TimeoutError):
                raise RequestTimeoutError(
                    f"waited {self.wait_s:.0f} s for one of this router's slots"
                ) from None
            raise

    def leave(self, cost: int = 1) -> None:
        if self.limit <= 0:
            return
        self.in_use -= cost
        self._wake()

    def _give_up(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        """A waiter timed out or was cancelled: slots granted meanwhile go back, and the ones
        behind it may now fit."""
        cost, fut = entry
        if fut.done() and not fut.cancelled():
            self.leave(cost)
            return
        with contextlib.suppress(ValueError):
            self._waiters.remove(entry)
        self._wake()

    def _wake(self) -> None:
        """Grant slots to the waiters at the head of the queue while they fit."""
        while self._waiters:
            cost, fut = self._waiters[0]
            if fut.done():  # given up; _give_up removes it too
                self._waiters.popleft()
                continue
            if self.in_use + cost > self.limit:
                return
            self._waiters.popleft()
            self.in_use += cost
            fut.set_result(None)
