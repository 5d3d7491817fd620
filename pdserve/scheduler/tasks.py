"""Stopping background tasks reliably."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[Any], retry_s: float = 0.05) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling again while it runs on.

    One ``cancel()`` is not enough on Python < 3.12: redis-py sends commands through
    ``asyncio.wait_for`` (when a socket timeout is set), which swallows a cancellation that
    arrives just as the send completes (CPython gh-86296), and the task would read on.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.cancelled() and task.exception() is not None:
        logger.error("task %s had failed", task.get_name(), exc_info=task.exception())
