"""Finalizing a batch: its output and error files written from its recorded outcomes
(:class:`OutputMove`: moved out of Redis's hashes a piece at a time, so a nearly full Redis can take
them), and its final status, counts and file ids in its record.

A try that fails is never the end of a batch's results:

- for lack of room that can come back (Redis full or unreachable, ``--files-dir``'s disk full) it
  is a *wait*, not a try: the next comes later, backing off from ``FINALIZE_RETRY_S`` to
  ``FINALIZE_RETRY_MAX_S``, with the reason on the batch (``errors``) while it waits; whatever was
  moved stays moved, and the batch completes once there is room, each line once, however long
  that takes (its lines all ran: there is nothing an end would save);
- any other failure (a fault) is a counted *try*, retried the same way; once its window has ended
  and ``MAX_FINALIZE_TRIES`` tries have failed, the batch is ``failed`` (``finalize_failed``) with
  the reason, and its outcomes are kept with its record (30 days): those moved in its output's
  partial keys, the rest in its hashes; ``pdserve status --batch-output BATCH_ID`` writes them out.
"""

from __future__ import annotations

import errno
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pdserve.batch.validation import Line
from pdserve.batchstore.batches import BatchError, BatchObject, BatchStore
from pdserve.batchstore.files import FileStore
from pdserve.batchstore.output_move import OutputMove
from pdserve.errors import ControlPlaneError, NotFoundError, PdserveError
from pdserve.scheduler.redis_server import redis_errors

logger = logging.getLogger(__name__)

MAX_FINALIZE_TRIES = 3
"""Failed tries (faults, not waits for room) after which a batch past its window is ``failed``."""
FINALIZE_RETRY_S = 10.0
"""How long the reaper waits after the first failed try or wait; doubled after each, up to the next."""
FINALIZE_RETRY_MAX_S = 300.0
INPUT_MISSING = BatchError(code="input_file_missing", message="the input file is gone")
INPUT_MISSING_ERRORS = {"object": "list", "data": [INPUT_MISSING.model_dump()]}


def retry_in(attempts: int) -> float:
    """Seconds before the next try, after ``attempts`` failed tries and waits."""
    return min(FINALIZE_RETRY_S * 2 ** max(attempts - 1, 0), FINALIZE_RETRY_MAX_S)


def lacks_room(error: BaseException) -> bool:
    """A failure that time or an operator cures and the batch has no part in: Redis full or
    unreachable, or the disk of ``--files-dir`` full."""
    return isinstance(error, ControlPlaneError) or (
        isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    )


class Finalizer:
    """Finalizes batches for one batch worker (the chunk job that wrote a batch's last line, or
    the reaper: several may finalize one batch at once, and agree)."""

    def __init__(
        self,
        batches: BatchStore,
        files: FileStore,
        lines: Callable[[BatchObject], Awaitable[list[Line]]],
        done_with: Callable[[str], None],
    ) -> None:
        self.batches = batches
        self.files = files
        self.move = OutputMove(batches, files)
        self._lines = lines
        self._done_with = done_with
        self._put_off: dict[str, float] = {}
        """Retry times kept here when Redis could not record them (at its ``maxmemory``)."""

    async def due(self, batch_id: str) -> bool:
        """False while a failed try or a wait puts the next one off."""
        if time.time() < self._put_off.get(batch_id, 0.0):
            return False
        return await self.batches.finalize_due(batch_id)

    async def maybe_finalize(self, batch_id: str) -> None:
        """Write the output files and complete the batch once every line has an outcome."""
        batch = await self.batches.get(batch_id)
        counts = batch.request_counts
        if batch.status != "in_progress" or counts.completed + counts.failed < counts.total:
            return
        if await self.batches.update(
            batch_id, ("in_progress",), status="finalizing", finalizing_at=int(time.time())
        ):
            await self.finish(batch_id, "finalizing", "completed")

    async def finish(
        self, batch_id: str, expect: str, status: str, unfinished_error: str = "", **changes: Any
    ) -> None:
        """Write the output and error files from the recorded lines and move the batch from
        ``expect`` to ``status``; lines with no outcome get ``unfinished_error`` in the error file
        (an expired batch's, as OpenAI writes them); ``changes`` go into the record too. A batch
        whose input file is gone when its unfinished lines need it (their ``custom_id``) is
        ``failed`` (``input_file_missing``) instead, with the outcomes recorded. A try that fails
        is put off (see the module's docstring), never raised."""
        try:
            await self._finish(batch_id, expect, status, unfinished_error, changes)
            self._put_off.pop(batch_id, None)
        except Exception as e:
            await self._failed(batch_id, expect, e)
        finally:
            self._done_with(batch_id)

    async def _finish(
        self, batch_id: str, expect: str, status: str, unfinished_error: str, changes: dict[str, Any]
    ) -> None:
        batch = await self.batches.get(batch_id)
        if batch.status != expect:  # another worker finalized it meanwhile (or it was cancelled)
            logger.info(
                "batch %s is %s, not %s: not writing its output again", batch_id, batch.status, expect
            )
            return
        if self.files.directory is None:
            await self.move.check_room(batch_id)  # before anything: a wait costs nothing then
        if unfinished_error and await self.move.state(batch_id) is None:  # not once lines moved
            try:
                await self._fill_unfinished(batch, status, unfinished_error)
            except NotFoundError:
                logger.error("batch %s: its input file is gone; failing it", batch_id)
                status, changes = "failed", {**changes, "errors": INPUT_MISSING_ERRORS}
        if self.files.directory is None:
            state = await self.move.move(batch)
            ids = await self.move.publish(batch, state)
            completed, failed = state.completed, state.failed
        else:
            ids, completed, failed = await self.move.write_to_files_dir(batch)
        if batch.errors is not None and "errors" not in changes:
            changes["errors"] = None  # the reason it waited for: done with
        stamp = {f"{status}_at": int(time.time())}
        moved = await self.batches.update(
            batch_id, (expect,), status=status, completed=completed, failed=failed, **stamp, **ids, **changes
        )
        if moved is None:  # a finish racing this one moved the batch first
            logger.info("batch %s was finalized by another worker meanwhile", batch_id)
        if self.files.directory is not None:
            if moved is None:  # this try's files are not the batch's (a Redis move shares its files)
                for file_id in filter(None, ids.values()):
                    await self.files.delete(file_id)
            else:  # its outcomes are in its files now
                keys = self.batches.keys
                with redis_errors("deleting a batch's outcomes"):
                    await self.batches.redis.delete(keys.batch_results(batch_id), keys.batch_errors(batch_id))

    async def _fill_unfinished(self, batch: BatchObject, status: str, unfinished_error: str) -> None:
        """Record ``unfinished_error`` for every line with no outcome (it needs their ``custom_id``:
        NotFoundError when the input file is gone)."""
        done = await self.batches.done_lines(batch.id)
        if len(done) >= batch.request_counts.total:
            return
        lines = await self._lines(batch)
        for i in range(batch.request_counts.total):
            if i not in done:
                record = {
                    "id": f"batch_req_{secrets.token_hex(12)}",
                    "custom_id": lines[i].custom_id,
                    "response": None,
                    "error": {
                        "code": unfinished_error,
                        "message": f"the batch {status} before this line ran",
                    },
                }
                await self.batches.record(batch.id, i, record, True)

    async def _failed(self, batch_id: str, expect: str, error: Exception) -> None:
        """Put a failed try off (a wait when :func:`lacks_room`), say why on the batch, and fail it
        once it is past its window and MAX_FINALIZE_TRIES faults have failed."""
        waiting = lacks_room(error)
        reason = error.message if isinstance(error, PdserveError) else f"{type(error).__name__}: {error}"
        try:
            tries = await self.batches.finalize_put_off(batch_id, not waiting, retry_in)
            self._put_off.pop(batch_id, None)
        except PdserveError:  # Redis takes no write (or none at all): keep the time here
            tries = 0
            self._put_off[batch_id] = time.time() + retry_in(2)
        try:
            batch = await self.batches.get(batch_id)
            if not waiting and tries >= MAX_FINALIZE_TRIES and time.time() >= batch.expires_at:
                await self._fail(batch, expect, tries, reason)
                return
            code = error.kind if isinstance(error, ControlPlaneError) else "finalize_retrying"
            if waiting and code == "finalize_retrying":
                code = "finalize_waiting"  # the disk of --files-dir is full
            message = (
                f"the batch's output files are not written yet ({reason}); they will be when "
                f"{'there is room' if waiting else 'a try succeeds'}: nothing is lost, every line's "
                "outcome is kept until then"
            )
            waiting_error = {"object": "list", "data": [{"code": code, "message": message}]}
            await self.batches.update(batch_id, (expect,), errors=waiting_error)
        except PdserveError as e:
            logger.warning("batch %s: could not record why its finalization waits: %s", batch_id, e)
        log = logger.warning if waiting or isinstance(error, PdserveError) else logger.exception
        log("batch %s: writing its output files failed (%s); trying again later", batch_id, reason)

    async def _fail(self, batch: BatchObject, expect: str, tries: int, reason: str) -> None:
        """A batch past its window whose files could not be written: ``failed``, its outcomes kept."""
        message = (
            f"the batch's output files could not be written ({tries} tries, the last: {reason}); its "
            f"lines' outcomes are kept for {self.batches.ttl_s // 86400} days: `pdserve status "
            f"--batch-output {batch.id}` writes them out"
        )
        error = BatchError(code="finalize_failed", message=message)
        errors = {"object": "list", "data": [error.model_dump()]}
        await self.batches.update(
            batch.id, (expect,), status="failed", failed_at=int(time.time()), errors=errors
        )
        await self.move.keep(batch.id, self.batches.ttl_s)
        logger.error("batch %s failed: %s", batch.id, message)
