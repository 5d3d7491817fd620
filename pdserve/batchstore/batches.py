"""The batches of the Batch API (``/v1/batches``): OpenAI's batch object, its state machine, and
the per-line results, in Redis.

A batch's record (``Keys.batch``) changes only through :data:`_UPDATE`, a script that applies a
change if the status is one of those expected: a cancel, a finalize and an expiry racing each other
end in exactly one final status. Each line's outcome is written once (:data:`_RECORD`: into the
results or the errors hash, never both, never twice), so a chunk run again after a crash neither
loses nor doubles a line; ``request_counts`` are the two hashes' sizes.

    validating ──> in_progress ──> finalizing ──> completed
        │              │   └──────────────────────> expired     (completion_window passed)
        ├─> failed     └──> cancelling ──> cancelled
        └─> expired    (no live instance to validate against before the window ended)

A batch whose output files cannot be written (:meth:`finalize_failed` counts the tries) goes from
``finalizing``, ``cancelling`` or ``in_progress`` (expiring) to ``failed`` instead, and so does one
whose input file is gone when a chunk or its expiry needs it (``input_file_missing``).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any, Literal, cast

import orjson
from pydantic import BaseModel, ConfigDict, Field

from pdserve.batchstore.file_object import new_id
from pdserve.batchstore.owners import OwnerIndex, Quotas, owner_name
from pdserve.errors import InvalidRequestError, NotFoundError
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.redis_server import redis_errors

logger = logging.getLogger(__name__)

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
_FINAL_JSON = orjson.dumps(sorted(FINAL_STATUSES))
ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")
"""What a batch may run (each line's ``url`` is one of them; a file may mix the two)."""

_WINDOW_RE = re.compile(r"(\d{1,9})([smhd])")
"""At most 9 digits (7 days are 604800 s): ``int()`` never sees a longer string (past 4300 digits it
raises a ValueError of its own)."""
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400
DEFAULT_BATCH_TTL_S = 30 * 24 * 3600
"""How long a finished batch's record and results stay (thirty days, like its output files)."""


def window_seconds(window: str) -> int:
    """``completion_window`` in seconds: OpenAI's ``24h``, or any ``<n>s|m|h|d`` up to 7 days."""
    m = _WINDOW_RE.fullmatch(window.strip()) if isinstance(window, str) else None
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        given = f"{window[:40]!r}…" if isinstance(window, str) and len(window) > 40 else repr(window)
        raise InvalidRequestError(
            f"completion_window must be a duration such as '24h' (or '<n>s', '<n>m', '<n>d'), "
            f"between 1 s and 7 days; got {given}",
            "completion_window",
        )
    return seconds


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    """One reason a batch failed validation (``line`` is 1-based, as OpenAI reports it)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    """OpenAI's batch object (``request_counts`` filled from the result hashes when read)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    chunks: int = Field(default=0, exclude=True)
    """How many rq jobs the lines were split into (pdserve's, not shown to clients)."""
    chunk_lines: int = Field(default=0, exclude=True)
    owner: str = Field(default="", exclude=True)
    """The tenant that made it (a digest of its API key, ``router.http.tenants``; ``""``: anonymous):
    only it sees the batch, its output files are its, and its lines run with its prefix-cache salt."""
    validation_failures: int = Field(default=0, exclude=True)
    """Validation jobs of this batch that raised (the batch fails after a few)."""
    counted: bool = Field(default=False, exclude=True)
    """Its record holds its final counts (its outcomes went into its output files)."""

    @property
    def final(self) -> bool:
        return self.status in FINAL_STATUSES

    def visible_to(self, owner: str | None) -> bool:
        """``owner`` may see the batch (None: pdserve itself, which sees every batch)."""
        return owner is None or self.owner == owner

    def chunk_range(self, chunk: int) -> range:
        """The 0-based line numbers of ``chunk``."""
        start = chunk * self.chunk_lines
        return range(start, min(start + self.chunk_lines, self.request_counts.total))


# KEYS[1] record, KEYS[2] active set; ARGV[1] JSON list of expected statuses, ARGV[2] JSON patch.
# Returns the new record, or nil when the status was not one expected (or there is no record).
_UPDATE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return nil end
local batch = cjson.decode(raw)
local ok = false
for _, s in ipairs(cjson.decode(ARGV[1])) do if batch.status == s then ok = true end end
if not ok then return nil end
for k, v in pairs(cjson.decode(ARGV[2])) do batch[k] = v end
local out = cjson.encode(batch)
redis.call('SET', KEYS[1], out, 'KEEPTTL')
if ARGV[3] == '1' then redis.call('SREM', KEYS[2], batch.id) end
return out
"""

# KEYS[1] results, KEYS[2] errors, KEYS[3] record, KEYS[4] its finalization; ARGV[1] line, ARGV[2]
# '1' for an error, ARGV[3] the line's JSON, ARGV[4] JSON list of the final statuses. Returns 1 if
# written, 0 if the line has an outcome already, -1 if the batch is final or gone, or its outcomes
# are being moved into its output files (its counts and output files are settled).
_RECORD = """
local raw = redis.call('GET', KEYS[3])
if not raw then return -1 end
if redis.call('HEXISTS', KEYS[4], 'line') == 1 then return -1 end
local status = cjson.decode(raw).status
for _, s in ipairs(cjson.decode(ARGV[4])) do if status == s then return -1 end end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[tonumber(ARGV[2]) + 1], ARGV[1], ARGV[3])
return 1
"""


class BatchStore:
    """Batch records, their status changes, and their lines' outcomes."""

    def __init__(
        self, redis: RedisClient, keys: Keys, ttl_s: int = DEFAULT_BATCH_TTL_S, quotas: Quotas | None = None
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.owners = OwnerIndex(redis, keys, quotas)
        self._update = redis.register_script(_UPDATE)
        self._record = redis.register_script(_RECORD)

    async def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        batch_id: str | None = None,
        owner: str = "",
    ) -> BatchObject:
        now = int(time.time())
        batch = BatchObject(
            id=batch_id or new_id("batch_"),
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status="validating",
            created_at=now,
            expires_at=now + window_seconds(completion_window),
            metadata=metadata,
            owner=owner,
        )
        with redis_errors("creating a batch"):
            pipe = self.redis.pipeline(
                transaction=False
            )  # three slots: the batch's, its owner's, the registry's
            pipe.set(self.keys.batch(batch.id), _dump(batch))
            pipe.zadd(self.keys.owner_batches(owner), {batch.id: time.time() * 1000})
            pipe.sadd(self.keys.owner_active(owner), batch.id)
            pipe.sadd(self.keys.active_batches, batch.id)
            pipe.sadd(self.keys.owners, owner_name(owner))
            await pipe.execute()
        logger.info("batch %s created: file %s, endpoint %s", batch.id, input_file_id, endpoint)
        return batch

    async def admit(self, owner: str, batch_id: str) -> None:
        """Count ``batch_id`` among ``owner``'s batches in flight before it is made (QuotaExceededError
        when it has its quota of them: ``--quota-batches``); :meth:`create` records it, and a batch
        never made is uncounted with :meth:`not_made`."""
        await self.owners.admit_batch(owner, batch_id, self.still_active)

    async def not_made(self, owner: str, batch_id: str) -> None:
        """A batch :meth:`admit` counted was not made after all."""
        await self.owners.batch_ended(owner, batch_id)

    async def still_active(self, batch_ids: list[str]) -> set[str]:
        """Those of ``batch_ids`` that exist and are not final (one round trip)."""
        if not batch_ids:
            return set()
        with redis_errors("reading batches"):
            pipe = self.redis.pipeline(transaction=False)
            for batch_id in batch_ids:
                pipe.get(self.keys.batch(batch_id))
            raws = await pipe.execute()
        return {i for i, raw in zip(batch_ids, raws) if raw is not None and not _load(raw).final}

    async def get(self, batch_id: str, owner: str | None = None) -> BatchObject:
        """The batch with its current request counts; NotFoundError when there is none, or
        ``owner`` (a tenant; None: any) is not the one that made it (the same answer)."""
        try:
            self.keys.batch(batch_id)  # ValueError for a malformed id
        except ValueError:
            raise NotFoundError(f"No such batch: {batch_id!r}", "batch_id") from None
        with redis_errors("reading a batch"):
            pipe = self.redis.pipeline(transaction=False)
            self._read(pipe, batch_id)
            batch = _counted(*await pipe.execute())
        if batch is None or not batch.visible_to(owner):
            raise NotFoundError(f"No such batch: {batch_id}", "batch_id")
        return batch

    def _read(self, pipe: Any, batch_id: str) -> None:
        """Queue what :func:`_counted` makes a batch of: its record and what says its counts."""
        pipe.get(self.keys.batch(batch_id))
        pipe.hlen(self.keys.batch_results(batch_id))
        pipe.hlen(self.keys.batch_errors(batch_id))
        pipe.hmget(self.keys.batch_finalize(batch_id), ["completed", "failed"])

    async def list_batches(
        self, after: str | None = None, limit: int = 20, owner: str = ""
    ) -> tuple[list[BatchObject], bool]:
        """``owner``'s batches newest first after the id ``after``; ``(batches, has_more)``. Reads
        that owner's index only (a page, then each batch's record and counts in one pipeline): what
        other owners hold costs it nothing. Ids whose record expired are dropped as they are met."""
        found: list[BatchObject] = []
        index, cursor, more = self.keys.owner_batches(owner), after, True
        while more and len(found) <= limit:
            wanted = limit + 1 - len(found)
            ids = await self.owners.page(index, cursor, wanted)
            more = len(ids) == wanted  # a short page is the index's end: no round trip to learn it
            if not ids:
                break
            cursor = ids[-1]
            with redis_errors("listing batches"):
                pipe = self.redis.pipeline(transaction=False)
                for batch_id in ids:
                    self._read(pipe, batch_id)
                replies = await pipe.execute()
            gone = []
            for n, batch_id in enumerate(ids):
                batch = _counted(*replies[4 * n : 4 * n + 4])
                if batch is None:
                    gone.append(batch_id)
                else:
                    found.append(batch)
            if gone:
                with redis_errors("listing batches"):
                    await self.redis.zrem(index, *gone)
        return found[:limit], len(found) > limit

    async def is_active(self, batch_id: str) -> bool:
        """The batch exists and is not final."""
        try:
            return not (await self.get(batch_id)).final
        except NotFoundError:
            return False

    async def active(self) -> list[str]:
        """Ids of the batches not in a final state."""
        with redis_errors("listing active batches"):
            return sorted(
                i.decode() for i in cast(set[bytes], await self.redis.smembers(self.keys.active_batches))
            )

    async def update(self, batch_id: str, expect: tuple[str, ...], **changes: Any) -> BatchObject | None:
        """Apply ``changes`` if the status is one of ``expect``; the new record, or None if it was not.
        A change to a final status drops the batch from the active set and starts its expiry."""
        final = changes.get("status") in FINAL_STATUSES
        with redis_errors("updating a batch"):
            raw = await self._update(
                keys=[self.keys.batch(batch_id), self.keys.active_batches],
                args=[orjson.dumps(list(expect)), orjson.dumps(changes), "1" if final else "0"],
            )
            if raw is not None and final:
                ended = _load(raw)
                pipe = self.redis.pipeline(transaction=False)
                # its input file may be deleted now (FileStore.hold recorded the batch as reading it)
                pipe.srem(self.keys.file_batches(ended.input_file_id), batch_id)
                pipe.srem(self.keys.owner_active(ended.owner), batch_id)  # no longer in flight
                for key in (self.keys.batch(batch_id), self.keys.batch_results(batch_id)):
                    pipe.expire(key, self.ttl_s)
                pipe.expire(self.keys.batch_errors(batch_id), self.ttl_s)
                pipe.delete(self.keys.batch_chunks(batch_id))
                # the state of its outcomes' move stays as long as they do (OutputMove.outcomes)
                pipe.expire(self.keys.batch_finalize(batch_id), self.ttl_s)
                await pipe.execute()
        if raw is None:
            return None
        batch = _load(raw)
        logger.info("batch %s: %s", batch_id, batch.status)
        return batch

    async def record(self, batch_id: str, line: int, output: dict, error: bool) -> bool:
        """Write line ``line``'s outcome unless it has one, or the batch is final (its counts and
        output files are settled: a line answered after that is dropped) or gone; True if this
        call wrote it."""
        with redis_errors("recording a batch line"):
            written = await self._record(
                keys=[
                    self.keys.batch_results(batch_id),
                    self.keys.batch_errors(batch_id),
                    self.keys.batch(batch_id),
                    self.keys.batch_finalize(batch_id),
                ],
                args=[line, "1" if error else "0", orjson.dumps(output), _FINAL_JSON],
            )
        if written == -1:
            logger.info("batch %s is final or gone: line %d's outcome is not recorded", batch_id, line)
        return written == 1

    async def done_lines(self, batch_id: str) -> set[int]:
        """Line numbers that have an outcome."""
        with redis_errors("reading a batch's lines"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hkeys(self.keys.batch_results(batch_id))
            pipe.hkeys(self.keys.batch_errors(batch_id))
            out, err = await pipe.execute()
        return {int(i) for i in (*out, *err)}

    async def outcomes(self, batch_id: str) -> tuple[list[bytes], list[bytes]]:
        """Every recorded result line and error line, each in line order."""
        with redis_errors("reading a batch's lines"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(self.keys.batch_results(batch_id))
            pipe.hgetall(self.keys.batch_errors(batch_id))
            out, err = await pipe.execute()
        return _in_order(out), _in_order(err)

    # ---- finalizing: tries at writing the output files that failed, and waits for room -------------
    async def finalize_put_off(self, batch_id: str, counted: bool, retry_in: Callable[[int], float]) -> int:
        """Record a try at writing ``batch_id``'s output files that failed: ``counted`` (a fault) or a
        wait (for room in Redis, or Redis itself), and put the next one off by ``retry_in(n)`` s, ``n``
        the tries and waits so far; the counted tries (kept in Redis: any worker may try next)."""
        key = self.keys.batch_finalize(batch_id)
        with redis_errors("counting a batch's finalize tries"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.hincrby(key, "tries" if counted else "waits", 1)
            pipe.hmget(key, ["tries", "waits"])
            _, (tries, waits) = await pipe.execute()
            tries, waits = int(tries or 0), int(waits or 0)
            await self.redis.hset(key, "retry_at", time.time() + retry_in(tries + waits))
        return tries

    async def finalize_due(self, batch_id: str) -> bool:
        """False while a failed try at writing the output files puts the next one off."""
        with redis_errors("reading a batch's finalize tries"):
            retry_at = await self.redis.hget(self.keys.batch_finalize(batch_id), "retry_at")
        return retry_at is None or time.time() >= float(retry_at)

    # ---- chunks: which rq job owns each chunk, and who is running it ------------------------------
    async def set_chunk_jobs(self, batch_id: str, jobs: dict[int, str]) -> None:
        with redis_errors("recording a batch's jobs"):
            await self.redis.hset(self.keys.batch_chunks(batch_id), mapping=dict(jobs.items()))

    async def chunk_jobs(self, batch_id: str) -> dict[int, str]:
        with redis_errors("reading a batch's jobs"):
            raw = cast(dict[bytes, bytes], await self.redis.hgetall(self.keys.batch_chunks(batch_id)))
        return {int(k): v.decode() for k, v in raw.items()}

    async def hold_lease(self, batch_id: str, chunk: int, holder: str, ttl_ms: int) -> None:
        with redis_errors("renewing a batch lease"):
            await self.redis.set(self.keys.batch_lease(batch_id, chunk), holder, px=ttl_ms)

    async def release_lease(self, batch_id: str, chunk: int) -> None:
        with redis_errors("releasing a batch lease"):
            await self.redis.delete(self.keys.batch_lease(batch_id, chunk))

    async def leased_chunks(self, batch: BatchObject) -> set[int]:
        """Chunks whose lease is held (some batch worker is running them)."""
        if not batch.chunks:
            return set()
        with redis_errors("reading batch leases"):
            held = await self.redis.mget([self.keys.batch_lease(batch.id, k) for k in range(batch.chunks)])
        return {k for k, holder in enumerate(held) if holder is not None}


def _dump(batch: BatchObject) -> bytes:
    data = batch.model_dump(exclude={"request_counts"})
    data.update(
        chunks=batch.chunks,
        chunk_lines=batch.chunk_lines,
        total=batch.request_counts.total,
        owner=batch.owner,
        validation_failures=batch.validation_failures,
    )
    return orjson.dumps(data)


def _counted(raw: bytes | None, done: int, failed: int, moving: list[bytes | None]) -> BatchObject | None:
    """A batch from its record, with its counts: those its record holds once it is final; while its
    outcomes are moved into its output files (they leave its hashes), those counted when the move
    began; else its hashes' sizes."""
    if raw is None:
        return None
    batch = _load(raw)
    if not batch.counted:
        if moving[0] is not None and moving[1] is not None:
            done, failed = int(moving[0]), int(moving[1])
        batch.request_counts.completed, batch.request_counts.failed = done, failed
    return batch


def _load(raw: bytes) -> BatchObject:
    data = orjson.loads(raw)
    data["request_counts"] = {"total": data.pop("total", 0)}
    if "completed" in data and "failed" in data:  # written when it ended: its hashes are gone
        data["request_counts"].update(completed=data.pop("completed"), failed=data.pop("failed"))
        data["counted"] = True
    if data.get("metadata") == []:  # Lua's cjson writes an empty table as a list
        data["metadata"] = {}
    return BatchObject.model_validate(data)


def _in_order(lines: dict[bytes, bytes]) -> list[bytes]:
    return [lines[k] for k in sorted(lines, key=int)]
