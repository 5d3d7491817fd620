"""Stopping background tasks: ``cancel_and_wait`` ends a task that swallows a cancellation."""

from __future__ import annotations

import asyncio

from pdserve.scheduler.tasks import cancel_and_wait


async def _swallows_one_cancel(beats: list[float]) -> None:
    """Stands in for a task whose Redis call ate a cancellation (CPython < 3.12's ``wait_for``
    inside redis-py does when the cancel arrives as the send completes, gh-86296) and loops on."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True
        beats.append(asyncio.get_running_loop().time())


def test_a_task_that_swallows_a_cancel_is_cancelled_again_until_it_ends() -> None:
    async def main() -> tuple[bool, bool]:
        beats: list[float] = []
        once = asyncio.create_task(_swallows_one_cancel(beats))
        await asyncio.sleep(0.05)
        once.cancel()  # what `cancel(); await task` does: the task runs on
        await asyncio.wait({once}, timeout=0.3)
        ran_on = not once.done()
        await asyncio.wait_for(cancel_and_wait(once), 2)
        return ran_on, once.cancelled()

    ran_on, cancelled = asyncio.run(main())
    assert ran_on  # the stand-in really swallows one cancel
    assert cancelled
