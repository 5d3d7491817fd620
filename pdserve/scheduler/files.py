"""The files of the Batch API (``/v1/files``): OpenAI's file objects, kept where every router and
batch worker reads them.

Metadata always lives in Redis (``Keys.file``, expiring with the file). The bytes live in Redis too
by default (``Keys.file_content``): a docker-compose stack or a Kubernetes deployment then needs no
shared volume, and a file is exactly as durable as the batches that use it. With a directory
(``--files-dir``, a folder every router and batch worker mounts) the bytes go there instead and Redis
holds only metadata: for files too large to keep in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Literal, cast

import orjson
from pydantic import BaseModel, ConfigDict, Field

from pdserve.errors import ConflictError, InvalidRequestError, NotFoundError
from pdserve.scheduler.connection import RedisClient, redis_errors
from pdserve.scheduler.keys import Keys

logger = logging.getLogger(__name__)

Purpose = Literal["batch", "batch_output"]
PURPOSES: tuple[str, ...] = ("batch", "batch_output")
"""What a client may upload (``batch``) and what pdserve writes (a batch's output and error files)."""

DEFAULT_MAX_FILE_BYTES = 100 * 1024 * 1024
DEFAULT_FILE_TTL_S = 30 * 24 * 3600
"""Thirty days, as OpenAI keeps a batch's output files."""
HOLD_GRACE_S = 3600
"""How long past its batch's expiry an input file is kept at least (an expiring batch's error file
names the lines that did not run by their ``custom_id``, read from the input file)."""

# KEYS[1] metadata, KEYS[2] content (absent with --files-dir), KEYS[3] the set of batches reading it;
# ARGV[1] batch id, ARGV[2] keep for at least this many ms, ARGV[3] the expiry that makes (unix s).
# Returns the metadata, or nil when there is no file.
_HOLD = """
local raw = redis.call('GET', KEYS[1])
if not raw then return nil end
redis.call('SADD', KEYS[3], ARGV[1])
local want = tonumber(ARGV[2])
local ttl = redis.call('PTTL', KEYS[1])
if ttl >= 0 and ttl < want then
  local info = cjson.decode(raw)
  info.expires_at = tonumber(ARGV[3])
  raw = cjson.encode(info)
  redis.call('SET', KEYS[1], raw, 'PX', want)
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], want) end
  ttl = want
end
if ttl >= 0 then redis.call('PEXPIRE', KEYS[3], ttl) end
return raw
"""

# KEYS as _HOLD's. Deletes the file unless some batch reads it: -1 then, else 1 (0: no file).
_DELETE = """
if redis.call('SCARD', KEYS[3]) > 0 then return -1 end
local existed = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
return existed
"""


class FileObject(BaseModel):
    """OpenAI's file object."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: Purpose
    status: Literal["processed"] = "processed"
    owner: str = Field(default="", exclude=True)
    """The tenant that made it (a digest of its API key, ``router.tenants``; ``""``: anonymous).
    Stored with the metadata, never shown to clients."""

    def visible_to(self, owner: str | None) -> bool:
        """``owner`` may see the file (None: pdserve itself, which sees every file)."""
        return owner is None or self.owner == owner


def _stored(info: FileObject) -> bytes:
    """A file's metadata as Redis keeps it: the client's view plus the owner."""
    return orjson.dumps({**info.model_dump(mode="json"), "owner": info.owner})


def new_id(prefix: str) -> str:
    """An id in OpenAI's style (``file-…``, ``batch_…``), valid as a key component."""
    return prefix + secrets.token_hex(12)


class FileStore:
    """Create, read, list and delete files (bytes in Redis, or in ``directory``)."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        max_bytes: int = DEFAULT_MAX_FILE_BYTES,
        ttl_s: int = DEFAULT_FILE_TTL_S,
        directory: str | Path | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.directory = Path(directory) if directory else None
        self._hold = redis.register_script(_HOLD)
        self._delete = redis.register_script(_DELETE)

    async def create(self, filename: str, purpose: str, content: bytes, owner: str = "") -> FileObject:
        """Store ``content`` as a new file of ``owner`` (a tenant: only it sees the file through the
        API); InvalidRequestError for a bad purpose, or an upload
        (``batch``) over ``max_bytes``. A batch's output and error files (``batch_output``, written
        by pdserve) are not bound by the upload limit: a batch's output is often larger than its
        input, and refusing it would leave the batch with no output at all."""
        if purpose not in PURPOSES:
            raise InvalidRequestError(f"purpose must be 'batch' (got {purpose!r})", "purpose")
        if purpose == "batch" and len(content) > self.max_bytes:
            raise InvalidRequestError(
                f"the file has {len(content)} bytes, more than this server's limit of {self.max_bytes}",
                "file",
            )
        now = int(time.time())
        info = FileObject(
            id=new_id("file-"),
            bytes=len(content),
            created_at=now,
            expires_at=now + self.ttl_s,
            filename=filename or "upload.jsonl",
            purpose=purpose,  # type: ignore[arg-type]  # checked above
            owner=owner,
        )
        if self.directory is not None:
            await asyncio.to_thread(self._write, info.id, content)
        with redis_errors("storing a file"):
            pipe = self.redis.pipeline(transaction=False)
            if self.directory is None:
                pipe.set(self.keys.file_content(info.id), content, ex=self.ttl_s)
            pipe.set(self.keys.file(info.id), _stored(info), ex=self.ttl_s)
            pipe.zadd(self.keys.files, {info.id: time.time() * 1000})
            await pipe.execute()
        logger.info("file %s stored: %s, %d bytes, purpose %s", info.id, info.filename, info.bytes, purpose)
        return info

    async def get(self, file_id: str, owner: str | None = None) -> FileObject:
        """The file's metadata; NotFoundError when there is none, or ``owner`` (a tenant; None: any)
        is not the one that made it (the same answer: nothing says another tenant's id exists)."""
        with redis_errors("reading a file"):
            raw = await self.redis.get(self._key(file_id))
        info = None if raw is None else FileObject.model_validate_json(raw)
        if info is None or not info.visible_to(owner):
            raise NotFoundError(f"No such file: {file_id}", "file_id")
        return info

    async def content(self, file_id: str, owner: str | None = None) -> bytes:
        info = await self.get(file_id, owner)
        if self.directory is not None:
            try:
                return await asyncio.to_thread(self._path(info.id).read_bytes)
            except FileNotFoundError:
                raise NotFoundError(f"The content of file {file_id} is gone", "file_id") from None
        with redis_errors("reading a file"):
            data = await self.redis.get(self.keys.file_content(info.id))
        if data is None:
            raise NotFoundError(f"No such file: {file_id}", "file_id")
        return cast(bytes, data)

    async def list_files(
        self,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10000,
        newest_first: bool = True,
        owner: str | None = None,
    ) -> tuple[list[FileObject], bool]:
        """Files in creation order (newest first by default) after the id ``after``; ``(files, has_more)``;
        only ``owner``'s (a tenant; None: every file). Ids whose file expired are dropped from the
        index as they are met."""
        with redis_errors("listing files"):
            ids = [
                i.decode()
                for i in cast(list[bytes], await self.redis.zrange(self.keys.files, 0, -1, desc=newest_first))
            ]
            if after is not None:
                ids = ids[ids.index(after) + 1 :] if after in ids else []
            found: list[FileObject] = []
            gone: list[str] = []
            for start in range(0, len(ids), 256):
                part = ids[start : start + 256]
                # one GET per file in a plain pipeline, not an MGET: each file's keys have its own
                # hash tag, so on a Redis Cluster they sit on different slots (the client splits the
                # pipeline per shard; an MGET across slots is refused)
                pipe = self.redis.pipeline(transaction=False)
                for i in part:
                    pipe.get(self.keys.file(i))
                values = await pipe.execute() if part else []
                for file_id, raw in zip(part, values):
                    if raw is None:
                        gone.append(file_id)
                        continue
                    info = FileObject.model_validate_json(raw)
                    if (purpose is None or info.purpose == purpose) and info.visible_to(owner):
                        found.append(info)
                if len(found) > limit:
                    break
            if gone:
                await self.redis.zrem(self.keys.files, *gone)
                if self.directory is not None:
                    for file_id in gone:
                        with contextlib.suppress(OSError):
                            self._path(file_id).unlink()
        return found[:limit], len(found) > limit

    async def hold(self, file_id: str, batch_id: str, until: float) -> FileObject:
        """Record that batch ``batch_id`` reads the file (:meth:`delete` refuses it until
        :meth:`release`) and keep the file at least until ``until`` (unix s) if it would expire
        sooner; NotFoundError when there is no file."""
        key = self._key(file_id)
        keep_ms = max(1, int((until - time.time()) * 1000))
        with redis_errors("holding a file"):
            raw = await self._hold(
                keys=[key, self.keys.file_content(file_id), self.keys.file_batches(file_id)],
                args=[batch_id, keep_ms, int(until)],
            )
        if raw is None:
            raise NotFoundError(f"No such file: {file_id}", "file_id")
        return FileObject.model_validate_json(raw)

    async def release(self, file_id: str, batch_id: str) -> None:
        """Batch ``batch_id`` no longer reads the file (it is final, or gone)."""
        with redis_errors("releasing a file"):
            await self.redis.srem(self._readers_key(file_id), batch_id)

    async def readers(self, file_id: str) -> list[str]:
        """The ids of the batches recorded as reading the file (:meth:`hold`), some maybe final."""
        with redis_errors("reading a file's batches"):
            ids = cast(set[bytes], await self.redis.smembers(self._readers_key(file_id)))
        return sorted(i.decode() for i in ids)

    async def delete(self, file_id: str, owner: str | None = None) -> None:
        """Delete a file; NotFoundError when there is none (or ``owner``, a tenant, did not make
        it), ConflictError while a batch reads it (the caller first releases the batches that are
        final: :meth:`release`)."""
        key = self._key(file_id)
        if owner is not None:
            await self.get(file_id, owner)
        with redis_errors("deleting a file"):
            deleted = await self._delete(
                keys=[key, self.keys.file_content(file_id), self.keys.file_batches(file_id)], args=[]
            )
            if deleted == -1:
                readers = await self.readers(file_id)
                raise ConflictError(
                    f"File {file_id} is the input file of batch {', '.join(readers)}, which has not "
                    "ended: cancel the batch, or wait until it ends, before deleting its input file",
                    "file_id",
                )
            await self.redis.zrem(self.keys.files, file_id)
        if self.directory is not None:
            with contextlib.suppress(FileNotFoundError):
                self._path(file_id).unlink()
        if not deleted:
            raise NotFoundError(f"No such file: {file_id}", "file_id")
        logger.info("file %s deleted", file_id)

    def _key(self, file_id: str) -> str:
        try:
            return self.keys.file(file_id)
        except ValueError:
            raise NotFoundError(f"No such file: {file_id!r}", "file_id") from None

    def _readers_key(self, file_id: str) -> str:
        self._key(file_id)  # NotFoundError for a malformed id
        return self.keys.file_batches(file_id)

    def _path(self, file_id: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{file_id}.jsonl"

    def _write(self, file_id: str, content: bytes) -> None:
        """Write to a temporary name and rename, so a reader never sees half a file."""
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{file_id}.tmp"
        tmp.write_bytes(content)
        os.replace(tmp, self._path(file_id))
