"""The rq job functions (named by path in :mod:`pdserve.batchstore.batch_queue`). rq calls them in
the batch worker's main thread; each hands its work to the worker's event loop, where the
in-process router runs, and waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from rq import get_current_job

from pdserve.batch.runner import BatchRunner

_context: tuple[BatchRunner, asyncio.AbstractEventLoop] | None = None


def install(runner: BatchRunner, loop: asyncio.AbstractEventLoop) -> None:
    """Make ``runner`` (running on ``loop``) the one these jobs use (``pdserve batch-worker`` does)."""
    global _context
    _context = (runner, loop)


def _run(make: Any, *args: Any) -> str:
    if _context is None:
        raise RuntimeError(
            "pdserve batch jobs run only in `pdserve batch-worker` (not in a plain `rq worker`)"
        )
    runner, loop = _context
    job = get_current_job()
    coro: Coroutine[Any, Any, str] = make(runner, *args, job.id if job is not None else "")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def validate_batch(batch_id: str) -> str:
    return _run(BatchRunner.validate, batch_id)


def run_chunk(batch_id: str, chunk: int) -> str:
    return _run(BatchRunner.run_chunk, batch_id, chunk)
