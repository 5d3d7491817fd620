"""Keeps the active batches moving whatever crashed: one batch worker at a time (a short Redis
lock) looks at every active batch each ``reaper_interval_s``.

- a chunk with lines left, no lease (nobody runs it) and an rq job not waiting in the queue (its
  worker was SIGKILLed while running it, or between rq popping it and registering it as started,
  or it stopped early) is enqueued again as a new job once that has lasted a lease TTL; the old
  job, should it ever run, sees it no longer owns the chunk and does nothing;
- a batch still ``validating`` whose validation job is lost the same way is validated again; one
  still ``validating`` at its window's end (no live instance came) is ``expired``;
- a batch ``cancelling``, or past its ``completion_window``, is finalized (partial output) once no
  chunk is leased; a batch left ``finalizing`` by a crash is finalized again.

Each batch is checked on its own: one that raises is logged and the pass goes on to the others. A
failed try at writing a batch's output files, or a wait for room, puts the next one off (with
backoff: :mod:`.finalize`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from pdserve.batch.runner import VALIDATION_CHUNK, BatchRunner
from pdserve.batchstore.batch_queue import job_attempt
from pdserve.batchstore.batches import BatchObject
from pdserve.errors import NotFoundError, PdserveError
from pdserve.scheduler.redis_server import redis_errors

logger = logging.getLogger(__name__)

FINALIZING_GRACE_S = 30.0
"""A batch ``finalizing`` this long was left so by a crash (writing its files takes far less)."""


class Reaper:
    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.batches = runner.batches
        self.queue = runner.queue
        self.settings = runner.settings
        self._suspects: dict[tuple[str, int], float] = {}
        self._queued: set[str] | None = None
        """The ids of the jobs waiting in the rq queue, read at most once per pass (the whole list:
        once per chunk it cost a pass chunks × queue length)."""

    async def run(self) -> None:
        """Forever: one pass per interval, logging what fails (Redis down: try again later)."""
        while True:
            try:
                await self.one_pass()
            except PdserveError as e:
                logger.warning("batch reaper: %s", e)
            except Exception:
                logger.exception("batch reaper failed; trying again")
            await asyncio.sleep(self.settings.reaper_interval_s)

    async def one_pass(self) -> None:
        redis, keys = self.batches.redis, self.batches.keys
        token = secrets.token_hex(8)
        ttl_ms = max(1000, int(self.settings.reaper_interval_s * 3000))
        with redis_errors("taking the batch reaper lock"):
            if not await redis.set(keys.batch_reaper_lock, token, nx=True, px=ttl_ms):
                return
        try:
            self._queued = None
            active = await self.batches.active()
            self.runner.metrics.active.set(len(active))
            self.runner.metrics.queue_depth.set(await asyncio.to_thread(self.queue.depth))
            for batch_id in active:
                try:
                    await self._check(await self.batches.get(batch_id))
                except NotFoundError:
                    with redis_errors("dropping an expired batch"):
                        await redis.srem(keys.active_batches, batch_id)
                except PdserveError as e:  # one batch's trouble stops no other's recovery
                    logger.warning("batch reaper: batch %s: %s", batch_id, e)
                except Exception:
                    logger.exception("batch reaper: batch %s failed; going on with the others", batch_id)
        finally:
            with redis_errors("releasing the batch reaper lock"):
                if await redis.get(keys.batch_reaper_lock) == token.encode():
                    await redis.delete(keys.batch_reaper_lock)

    async def _check(self, batch: BatchObject) -> None:
        now = time.time()
        finishing = batch.status in ("cancelling", "finalizing") or (
            batch.status == "in_progress" and now >= batch.expires_at
        )
        if finishing and not await self.runner.finalizer.due(batch.id):
            return  # a failed try at writing its output files put the next one off
        if batch.status == "validating":
            if now >= batch.expires_at:  # no instance came to validate it against, say
                await self.runner.expire_unvalidated(batch.id)
            else:
                await self._recover_validation(batch)
        elif batch.status == "cancelling":
            if not await self.batches.leased_chunks(batch):
                await self._cancel_queued(batch)
                await self.runner.finish(batch.id, "cancelling", "cancelled")
        elif batch.status == "finalizing":
            if batch.finalizing_at is not None and now - batch.finalizing_at > FINALIZING_GRACE_S:
                logger.warning("batch %s was left finalizing; finalizing it again", batch.id)
                await self.runner.finish(batch.id, "finalizing", "completed")
        elif batch.status == "in_progress":
            if now >= batch.expires_at:
                await self._expire(batch)
                return
            counts = batch.request_counts
            if counts.completed + counts.failed >= counts.total:
                await self.runner.maybe_finalize(batch.id)
            else:
                await self._recover_chunks(batch)

    async def _expire(self, batch: BatchObject) -> None:
        if await self.batches.leased_chunks(batch):
            return  # the chunks stop sending at the window's end; finalize when they have
        await self._cancel_queued(batch)
        logger.warning(
            "batch %s expired with %d of %d lines done",
            batch.id,
            batch.request_counts.completed + batch.request_counts.failed,
            batch.request_counts.total,
        )
        await self.runner.finish(batch.id, "in_progress", "expired", unfinished_error="batch_expired")

    async def _cancel_queued(self, batch: BatchObject) -> None:
        for job_id in (await self.batches.chunk_jobs(batch.id)).values():
            await asyncio.to_thread(self.queue.cancel, job_id)

    def _suspect(self, batch_id: str, chunk: int, suspicious: bool) -> bool:
        """True once ``suspicious`` has held for a lease TTL (a job just popped takes its lease fast)."""
        key = (batch_id, chunk)
        if not suspicious:
            self._suspects.pop(key, None)
            return False
        since = self._suspects.setdefault(key, time.monotonic())
        return time.monotonic() - since >= self.settings.lease_ttl_ms / 1000

    async def _waiting(self, job_id: str) -> bool:
        """The job waits in the rq queue, as the pass's one read of the queue saw it. A job enqueued
        since is missed, which a later pass corrects: a chunk is suspected for a lease TTL first."""
        if self._queued is None:
            self._queued = await asyncio.to_thread(self.queue.waiting_ids)
        return job_id in self._queued

    async def _lost(self, batch: BatchObject, chunk: int, job_id: str | None) -> bool:
        if job_id is not None and await self._waiting(job_id):
            return self._suspect(batch.id, chunk, False)
        return self._suspect(batch.id, chunk, True)

    async def _recover_validation(self, batch: BatchObject) -> None:
        leased = await self.batches.redis.exists(self.batches.keys.batch_lease(batch.id, VALIDATION_CHUNK))
        jobs = await self.batches.chunk_jobs(batch.id)
        job_id = jobs.get(VALIDATION_CHUNK, f"{batch.id}-validate")
        if leased or not await self._lost(batch, VALIDATION_CHUNK, job_id):
            return
        attempt = job_attempt(job_id) + 1
        new = await asyncio.to_thread(self.queue.enqueue_validate, batch.id, attempt)
        await self.batches.set_chunk_jobs(batch.id, {VALIDATION_CHUNK: new})
        self._suspects.pop((batch.id, VALIDATION_CHUNK), None)
        logger.warning("batch %s: validation job %s was lost; enqueued %s", batch.id, job_id, new)

    async def _recover_chunks(self, batch: BatchObject) -> None:
        leased = await self.batches.leased_chunks(batch)
        jobs = await self.batches.chunk_jobs(batch.id)
        done = await self.batches.done_lines(batch.id)
        for chunk in range(batch.chunks):
            if chunk in leased or all(i in done for i in batch.chunk_range(chunk)):
                self._suspect(batch.id, chunk, False)
                continue
            job_id = jobs.get(chunk)
            if not await self._lost(batch, chunk, job_id):
                continue
            attempt = job_attempt(job_id) + 1 if job_id else 1  # attempt 0 may be on its way
            new = await asyncio.to_thread(self.queue.enqueue_chunk, batch.id, chunk, attempt)
            await self.batches.set_chunk_jobs(batch.id, {chunk: new})
            self._suspects.pop((batch.id, chunk), None)
            status = await asyncio.to_thread(self.queue.status, job_id) if job_id else None
            logger.warning(
                "batch %s chunk %d: nobody runs it (job %s is %s); enqueued %s",
                batch.id,
                chunk,
                job_id,
                status,
                new,
            )
