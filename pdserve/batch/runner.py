"""What a batch worker does, as coroutines on its event loop: validate a batch, run a chunk of its
lines, finalize it, and (:mod:`.reaper`) recover what crashed workers left.

Each line is POSTed to the in-process router app (the same endpoint code as an online request:
body checks, model check, dispatch, retries, migration, structured output), one at a time per
free slot and only while the instances have spare capacity (:class:`SpareCapacity`). Its outcome
is written once per line (:meth:`BatchStore.record`), so running a chunk again skips what is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.batch.finalize import INPUT_MISSING, INPUT_MISSING_ERRORS, Finalizer
from pdserve.batch.input_lines import InputLines
from pdserve.batch.settings import BatchWorkerSettings
from pdserve.batch.spare_capacity import SpareCapacity
from pdserve.batch.validation import MAX_REASON_CHARS, Line, check_lines, read_lines
from pdserve.batchstore.batch_queue import BatchQueue
from pdserve.batchstore.batches import BatchError, BatchObject, BatchStore
from pdserve.batchstore.files import FileStore
from pdserve.errors import ControlPlaneError, NotFoundError, PdserveError
from pdserve.router.api.input_limits import InputLimits
from pdserve.router.http.app import RouterApp, create_app
from pdserve.router.http.state import RouterState
from pdserve.router.http.tenants import TENANT_HEADER, TrustedTenant
from pdserve.scheduler.registration import InstanceInfo
from pdserve.scheduler.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
"""Answers that say "not now": the line is sent again (after a pause) instead of failing."""
RETRY_PAUSE_S = (0.5, 5.0)
VALIDATION_CHUNK = -1
"""The chunk number under which a validation job holds its lease and records its job id."""
STATUS_MAX_AGE_S = 0.5
VALIDATION_POLL_S = 1.0
"""How often a validation with no live instance to check its lines against looks again."""
MAX_VALIDATION_FAILURES = 3
"""Validation jobs of one batch that may raise before the batch fails with the reason (each is run
again by the reaper a lease TTL after it failed; before, one kept failing until the window ended)."""


class BatchMetrics:
    """The batch worker's Prometheus metrics (served with ``--metrics-port``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lines = Counter(
            "pdserve_batch_lines", "Batch lines finished by this worker", ["outcome"], registry=self.registry
        )
        self.queue_depth = Gauge(
            "pdserve_batch_queue_depth", "Batch jobs waiting in the rq queue", registry=self.registry
        )
        self.active = Gauge("pdserve_batch_active", "Batches not yet final", registry=self.registry)
        self.in_flight = Gauge(
            "pdserve_batch_lines_in_flight", "Lines being sent now", registry=self.registry
        )


class BatchRunner:
    """The in-process router and the batch operations of one batch worker."""

    def __init__(self, settings: BatchWorkerSettings, queue: BatchQueue, metrics: BatchMetrics) -> None:
        self.settings = settings
        self.queue = queue
        self.metrics = metrics
        self.app: RouterApp = create_app(settings.router)
        self.state: RouterState = self.app.state.router
        self.limits = InputLimits.of(settings.router)
        self.stopping = False
        self._stack = contextlib.AsyncExitStack()
        self._client: httpx.AsyncClient | None = None
        self._lines = InputLines()
        self._status: dict[str, tuple[float, BatchObject]] = {}
        self._refreshing = asyncio.Lock()

    @property
    def files(self) -> FileStore:
        assert self.state.files is not None, "start() first"
        return self.state.files

    @property
    def batches(self) -> BatchStore:
        assert self.state.batches is not None, "start() first"
        return self.state.batches

    async def start(self) -> None:
        await self._stack.enter_async_context(self.app.router.lifespan_context(self.app))
        transport = httpx.ASGITransport(app=TrustedTenant(self.app))  # _post names each line's tenant
        timeout = httpx.Timeout(self.settings.router.request_timeout_s + 30)
        self._client = await self._stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url="http://batch-worker", timeout=timeout)
        )
        s = self.settings
        self.capacity = SpareCapacity(self.state, s.max_load, s.concurrency, s.busy_concurrency)
        self.finalizer = Finalizer(self.batches, self.files, self._batch_lines, self._lines.pop)

    async def stop(self) -> None:
        await self._stack.aclose()

    # ---- validation -----------------------------------------------------------------------------
    async def validate(self, batch_id: str, job_id: str) -> str:
        """Check every line as the online endpoint would; then split the batch into chunk jobs, or
        fail it with errors naming the lines. A validation that raises is counted on the batch and
        raised again (rq fails the job; the reaper runs it again after a lease TTL); the
        MAX_VALIDATION_FAILURES-th fails the batch with the reason instead. A Redis error is not
        counted: the batch is not at fault, and the next job runs once Redis answers."""
        batch = await self.batches.get(batch_id)
        async with self._owned(batch, "validating", VALIDATION_CHUNK, job_id) as renew:
            if renew is None:
                return "skipped: the batch is not validating or another job validates it"
            try:
                return await self._validate(batch, renew)
            except ControlPlaneError:
                raise
            except Exception as e:
                if await self._validation_failed(batch, e):
                    return "failed: its validation kept failing"
                raise

    async def _validation_failed(self, batch: BatchObject, error: Exception) -> bool:
        """Count a validation of ``batch`` that raised ``error``; True once that failed the batch."""
        failures = batch.validation_failures + 1
        reason = f"{type(error).__name__}: {error}"[:MAX_REASON_CHARS]
        if failures < MAX_VALIDATION_FAILURES:
            logger.exception(
                "batch %s: validation failed (%d of %d tries); the reaper runs it again",
                batch.id,
                failures,
                MAX_VALIDATION_FAILURES,
            )
            await self.batches.update(batch.id, ("validating",), validation_failures=failures)
            return False
        logger.exception("batch %s: validation failed %d times; failing the batch", batch.id, failures)
        message = f"validating the batch failed {failures} times: {reason}"
        await self._fail(batch, [BatchError(code="validation_failed", message=message)])
        return True

    async def _validate(self, batch: BatchObject, renew: asyncio.Task) -> str:
        batch_id = batch.id
        try:
            content = await self.files.content(batch.input_file_id)
        except NotFoundError:
            await self._fail(batch, [INPUT_MISSING])
            return "failed: the input file is gone"
        live = await self._live_instances(batch, renew)
        if live is None:
            return "stopped waiting for a live instance"
        # off the event loop: a large file takes seconds, and the lease must be renewed meanwhile
        lines, model, errors = await asyncio.to_thread(
            check_lines, content, live, self.limits, self.settings.max_lines
        )
        if errors:
            await self._fail(batch, errors)
            return "failed validation"
        chunk_lines = self.settings.chunk_lines
        chunks = -(-len(lines) // chunk_lines)
        now = int(time.time())
        started = await self.batches.update(
            batch_id,
            ("validating",),
            status="in_progress",
            in_progress_at=now,
            total=len(lines),
            chunks=chunks,
            chunk_lines=chunk_lines,
            model=model or None,
        )
        if started is None:  # cancelled or expired meanwhile
            return "skipped: the batch was cancelled or expired meanwhile"
        self._lines.put(batch_id, lines)
        jobs = {k: await asyncio.to_thread(self.queue.enqueue_chunk, batch_id, k) for k in range(chunks)}
        await self.batches.set_chunk_jobs(batch_id, jobs)
        logger.info(
            "batch %s: %d lines valid, %d jobs of %d lines", batch_id, len(lines), chunks, chunk_lines
        )
        return "validated"

    async def _live_instances(self, batch: BatchObject, renew: asyncio.Task) -> list[InstanceInfo] | None:
        """The live set once some instance is live (the lines' models are checked against it): with
        none (a restart, a deployment scaled to zero) validation waits, within the batch's window,
        instead of failing every line with ``model_not_found``. None when it stops waiting: the
        window ended (the batch is then ``expired``), the batch was cancelled, the worker stops or
        another job owns the validation."""
        waited = False
        while True:
            live = await self.state.dispatcher.live.get()
            if any(not info.draining for info in live):
                return live
            batch = await self.batches.get(batch.id)
            if batch.status != "validating" or self.stopping or renew.done():
                return None
            if time.time() >= batch.expires_at:
                await self.expire_unvalidated(batch.id)
                return None
            if not waited:
                logger.warning("batch %s: no live instance to validate its lines against; waiting", batch.id)
                waited = True
            await asyncio.sleep(VALIDATION_POLL_S)

    async def expire_unvalidated(self, batch_id: str) -> None:
        """End a batch still ``validating`` at its window's end as ``expired`` (no line ran)."""
        error = BatchError(
            code="batch_expired", message="the completion window ended before the batch was validated"
        )
        if await self.batches.update(
            batch_id,
            ("validating",),
            status="expired",
            expired_at=int(time.time()),
            errors={"object": "list", "data": [error.model_dump()]},
        ):
            logger.warning("batch %s expired before it was validated", batch_id)

    async def _fail(self, batch: BatchObject, errors: list[BatchError]) -> None:
        data = [e.model_dump() for e in errors]
        await self.batches.update(
            batch.id,
            ("validating",),
            status="failed",
            failed_at=int(time.time()),
            errors={"object": "list", "data": data},
        )
        logger.warning("batch %s failed validation: %s", batch.id, errors[0].message)

    # ---- running a chunk ------------------------------------------------------------------------
    async def run_chunk(self, batch_id: str, chunk: int, job_id: str) -> str:
        """Run the lines of ``chunk`` that have no outcome yet; returns what happened, for rq."""
        batch = await self.batches.get(batch_id)
        async with self._owned(batch, "in_progress", chunk, job_id) as renew:
            if renew is None:
                return "skipped: the batch is not running or another job owns this chunk"
            done = await self.batches.done_lines(batch_id)
            todo = [i for i in batch.chunk_range(chunk) if i not in done]
            try:
                lines = await self._batch_lines(batch)
            except NotFoundError:  # deleted or expired despite FileStore.hold (by hand, say)
                await self.finish(batch_id, "in_progress", "failed", errors=INPUT_MISSING_ERRORS)
                return "failed the batch: its input file is gone"
            outcomes = await asyncio.gather(*(self._run_line(batch, i, lines[i], renew) for i in todo))
        ran = sum(1 for o in outcomes if o)
        await self.maybe_finalize(batch_id)
        return f"{ran} of {len(todo)} lines run"

    @contextlib.asynccontextmanager
    async def _owned(
        self, batch: BatchObject, status: str, chunk: int, job_id: str
    ) -> AsyncIterator[asyncio.Task | None]:
        """Hold ``chunk``'s lease while the block runs, if the batch is ``status`` and no newer job
        owns the chunk; yields the task renewing the lease (done once ownership is lost), or None."""
        owner = (await self.batches.chunk_jobs(batch.id)).get(chunk)
        if batch.status != status or owner not in (None, job_id):
            yield None
            return
        renew = asyncio.create_task(self._hold_lease(batch.id, chunk, job_id))
        try:
            yield renew
        finally:
            # cancel_and_wait, not cancel() and await: a cancel swallowed by a Redis call left the
            # lease renewed forever, the chunk's job hung and the batch never expired
            await cancel_and_wait(renew)
            with contextlib.suppress(PdserveError):
                await self.batches.release_lease(batch.id, chunk)

    async def _hold_lease(self, batch_id: str, chunk: int, job_id: str) -> None:
        holder = f"{self.settings.name}:{job_id}"
        ttl_ms = self.settings.lease_ttl_ms
        while True:
            with contextlib.suppress(PdserveError):  # a blip: the next renewal may succeed
                if (await self.batches.chunk_jobs(batch_id)).get(chunk, job_id) != job_id:
                    logger.warning(
                        "batch %s chunk %d: another job owns it now; %s stops", batch_id, chunk, job_id
                    )
                    return  # the reaper gave the chunk to a new job: stop sending its lines
                await self.batches.hold_lease(batch_id, chunk, holder, ttl_ms)
            await asyncio.sleep(ttl_ms / 4000)

    async def _stopped(self, batch_id: str) -> bool:
        """The line should not be sent: the worker stops, or the batch is no longer running."""
        if self.stopping:
            return True
        cached = self._status.get(batch_id)
        if (
            cached is None or time.monotonic() - cached[0] > STATUS_MAX_AGE_S
        ) and not self._refreshing.locked():
            async with self._refreshing:  # one read for all the lines waiting; the others use the last
                with contextlib.suppress(PdserveError, TimeoutError):
                    batch = await asyncio.wait_for(self.batches.get(batch_id), STATUS_MAX_AGE_S * 10)
                    cached = self._status[batch_id] = (time.monotonic(), batch)
        if cached is None:
            return False
        batch = cached[1]
        return batch.status != "in_progress" or time.time() >= batch.expires_at

    async def _run_line(self, batch: BatchObject, index: int, line: Line, renew: asyncio.Task) -> bool:
        """Send one line until it has an answer that is not "not now"; False if it was not run."""
        pause = RETRY_PAUSE_S[0]

        async def stopped() -> bool:
            return renew.done() or await self._stopped(batch.id)

        room_key = self.batches.keys.batch_results(batch.id)

        while True:
            async with self.capacity.admit(line.model, stopped, room_key) as admitted:
                if not admitted:
                    return False
                self.metrics.in_flight.inc()
                try:
                    response = await self._post(line.url, line.body, batch.owner)
                finally:
                    self.metrics.in_flight.dec()
            if response.status_code not in RETRY_STATUSES:
                break
            logger.info(
                "batch %s line %d: %d, sent again in %.1f s", batch.id, index + 1, response.status_code, pause
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_PAUSE_S[1])
        failed = response.status_code >= 400
        request_id = response.headers.get("x-request-id", "")
        record = {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": line.custom_id,
            "response": {
                "status_code": response.status_code,
                "request_id": request_id,
                "body": _json_or_text(response.content),
            },
            "error": None,
        }
        if await self.batches.record(batch.id, index, record, failed):
            self.metrics.lines.labels("failed" if failed else "completed").inc()
        return True

    async def _post(self, endpoint: str, body: bytes, tenant: str = "") -> httpx.Response:
        """POST a line to the in-process app as ``tenant`` (the batch's owner: its prefix-cache salt)."""
        assert self._client is not None, "start() first"
        headers = {"content-type": "application/json", TENANT_HEADER.decode(): tenant}
        try:
            return await self._client.post(endpoint, content=body, headers=headers)
        except httpx.HTTPError as e:  # the in-process app failed to answer: try again later
            logger.warning("a batch line got no answer: %s", e)
            return httpx.Response(503, content=b'{"error": {"message": "no answer"}}')

    async def _batch_lines(self, batch: BatchObject) -> list[Line]:
        """The batch's checked lines (read once per worker and batch while it is among the last few
        this worker ran: :class:`InputLines`)."""
        lines = self._lines.get(batch.id)
        if lines is None:
            content = await self.files.content(batch.input_file_id)
            # off the event loop: 100 MB take seconds, and the chunk's lease must be renewed meanwhile
            lines = await asyncio.to_thread(read_lines, content, batch.model or "")
            self._lines.put(batch.id, lines)
        return lines

    # ---- finalizing (batch/finalize.py) ----------------------------------------------------------
    async def maybe_finalize(self, batch_id: str) -> None:
        """Write the output files and complete the batch once every line has an outcome."""
        await self.finalizer.maybe_finalize(batch_id)

    async def finish(
        self, batch_id: str, expect: str, status: str, unfinished_error: str = "", **changes: Any
    ) -> None:
        """Write the output files and move the batch from ``expect`` to ``status``
        (:meth:`Finalizer.finish`)."""
        await self.finalizer.finish(batch_id, expect, status, unfinished_error, **changes)


def _json_or_text(content: bytes) -> object:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode(errors="replace")
