"""The files of the Batch API (``/v1/files``) stored: :class:`FileStore` keeps OpenAI's file objects
(file_object.py) where every router and batch worker reads them, holds them for the batches reading
them, and deletes them.

Metadata always lives in Redis (``Keys.file``, expiring with the file). The bytes live in Redis too
by default (``Keys.file_content``): a docker-compose stack or a Kubernetes deployment then needs no
shared volume, and a file is exactly as durable as the batches that use it. With a directory
(``--files-dir``, a folder every router and batch worker mounts) the bytes go there instead and Redis
holds only metadata: for files too large to keep in memory.

A file is stored and read in pieces (:data:`CHUNK_BYTES`), never whole: :meth:`FileStore.store`
appends each piece to a partial key (or a hidden temporary file) that expires unless the next piece
comes, and makes it the file's content with its metadata in one script once the last piece is in; a
file that goes over the limit, or whose upload fails, leaves nothing. :meth:`FileStore.open` reads a
file piece by piece for a streamed answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from pathlib import Path
from typing import cast

from pdserve.batchstore.file_object import (
    DEFAULT_FILE_TTL_S,
    DEFAULT_MAX_FILE_BYTES,
    PURPOSES,
    FileObject,
    _stored,
    new_id,
)
from pdserve.batchstore.file_scripts import _DELETE, _HOLD, _PUBLISH
from pdserve.batchstore.owners import PAGE, OwnerIndex, Quotas
from pdserve.errors import ConflictError, ControlPlaneError, InvalidRequestError, NotFoundError
from pdserve.scheduler.keys import Keys
from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.redis_server import memory_room, redis_errors

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024
"""The most of a file one Redis command (or one write or read in ``--files-dir``) carries: a file is
stored and read in pieces of this size, so storing or sending one holds no more of it at once."""
PARTIAL_TTL_S = 600
"""How long a file being stored lasts past its latest piece (its partial key's TTL, renewed with
each piece; in ``--files-dir``, the age at which a temporary file is swept): an upload that fails,
or whose router dies, leaves nothing behind for longer."""


class FileStore:
    """Create, read, list and delete files (bytes in Redis, or in ``directory``)."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        max_bytes: int = DEFAULT_MAX_FILE_BYTES,
        ttl_s: int = DEFAULT_FILE_TTL_S,
        directory: str | Path | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.directory = Path(directory) if directory else None
        self.owners = OwnerIndex(redis, keys, quotas)
        self._hold = redis.register_script(_HOLD)
        self._delete = redis.register_script(_DELETE)
        self._publish = redis.register_script(_PUBLISH)
        self._swept_at = 0.0

    async def create(self, filename: str, purpose: str, content: bytes, owner: str = "") -> FileObject:
        """Store ``content`` as a new file of ``owner`` (a tenant: only it sees the file through the
        API); InvalidRequestError for a bad purpose, or an upload
        (``batch``) over ``max_bytes``. A batch's output and error files (``batch_output``, written
        by pdserve) are not bound by the upload limit: a batch's output is often larger than its
        input, and refusing it would leave the batch with no output at all. Written in pieces as
        :meth:`store` writes them (no Redis command carries more than CHUNK_BYTES)."""
        if purpose == "batch" and len(content) > self.max_bytes:
            raise InvalidRequestError(
                f"the file has {len(content)} bytes, more than this server's limit of {self.max_bytes}",
                "file",
            )
        return await self.store(filename, purpose, _one(content), owner)

    async def store(
        self, filename: str, purpose: str, pieces: AsyncIterable[bytes], owner: str = ""
    ) -> FileObject:
        """Store the bytes ``pieces`` yields, in order, as a new file of ``owner`` (as
        :meth:`create`), piece by piece: each is cut to CHUNK_BYTES and appended to the file's
        partial key (renewed to expire PARTIAL_TTL_S later) or, with ``directory``, written to a
        hidden temporary file; the whole file is never held here. The file appears (content and
        metadata at once) only when the last piece is stored. An upload (``batch``) that goes over
        ``max_bytes`` raises InvalidRequestError as soon as it does, and one ``owner``'s quotas
        refuse (:meth:`OwnerIndex.check_upload`: files held, bytes held with this upload so far)
        QuotaExceededError; a batch's output files are counted, never refused; then, and when ``pieces`` or
        Redis raises, or the caller is cancelled, what was stored is deleted (a router that dies
        meanwhile leaves a partial key that expires, or a temporary file that a later upload sweeps)."""
        if purpose not in PURPOSES:
            raise InvalidRequestError(f"purpose must be 'batch' (got {purpose!r})", "purpose")
        upload = purpose == "batch"
        file_id = new_id("file-")
        try:
            bound = await self._bound(file_id, owner) if upload else None
            if self.directory is not None:
                size = await self._write_pieces(file_id, pieces, bound)
            else:
                size = await self._append_pieces(file_id, pieces, bound)
            info = await self.publish(file_id, filename or "upload.jsonl", purpose, size, owner)
        except BaseException:
            await self._discard(file_id, owner)
            raise
        logger.info("file %s stored: %s, %d bytes, purpose %s", info.id, info.filename, info.bytes, purpose)
        return info

    async def publish(self, file_id: str, filename: str, purpose: str, size: int, owner: str) -> FileObject:
        """Make the ``size`` bytes stored for ``file_id`` (its partial key, or its temporary file,
        renamed already) the file of ``owner``, with its metadata, and count it in the owner's
        usage. Publishing a file twice publishes it once (a batch's output, by two finalizations)."""
        now = int(time.time())
        info = FileObject(
            id=file_id,
            bytes=size,
            created_at=now,
            expires_at=now + self.ttl_s,
            filename=filename,
            purpose=purpose,  # type: ignore[arg-type]  # one of PURPOSES: checked by the callers
            owner=owner,
        )
        with redis_errors("storing a file"):
            if self.directory is None:
                keys = [self.keys.file_partial(file_id), self.keys.file_content(file_id)]
                lost = await self._publish(
                    keys=[*keys, self.keys.file(file_id)], args=[_stored(info), self.ttl_s * 1000, size]
                )
                if lost != -1:
                    raise ControlPlaneError(
                        f"Redis lost part of file {file_id} while it was stored (it kept {lost} of "
                        f"{size} bytes: its partial key expired or was deleted); upload it again"
                    )
            else:
                await self.redis.set(self.keys.file(file_id), _stored(info), ex=self.ttl_s)
        await self.owners.add_file(owner, file_id, size, time.time() * 1000, info.expires_at or 0)
        return info

    async def open(
        self, file_id: str, owner: str | None = None
    ) -> tuple[FileObject, int, AsyncIterator[bytes]]:
        """The file's metadata, its size in bytes, and its bytes in pieces of at most CHUNK_BYTES,
        each read only when the one before has been taken (for a streamed answer: the whole file is
        never held). NotFoundError up front as :meth:`get`, or when the content is gone; a file
        deleted while it is read raises NotFoundError from the pieces."""
        info = await self.get(file_id, owner)
        if self.directory is not None:
            path = self._path(info.id)
            try:
                size = (await asyncio.to_thread(path.stat)).st_size
            except FileNotFoundError:
                raise NotFoundError(f"The content of file {file_id} is gone", "file_id") from None
            return info, size, self._read_file(info.id, path, size)
        key = self.keys.file_content(info.id)
        with redis_errors("reading a file"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.exists(key)
            pipe.strlen(key)
            exists, size = await pipe.execute()
        if not exists:
            raise NotFoundError(f"No such file: {file_id}", "file_id")
        return info, int(size), self._read_key(info.id, key, int(size))

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
        owner: str = "",
    ) -> tuple[list[FileObject], bool]:
        """``owner``'s files in creation order (newest first by default) after the id ``after``;
        ``(files, has_more)``. Reads that owner's index only, a page at a time: what other owners
        hold costs it nothing. Ids whose file expired are dropped from the index as they are met."""
        found: list[FileObject] = []
        index, cursor, more = self.keys.owner_files(owner), after, True
        while more and len(found) <= limit:
            wanted = limit + 1 - len(found) if purpose is None else PAGE  # some may be of another purpose
            ids = await self.owners.page(index, cursor, wanted, newest_first)
            more = len(ids) == wanted  # a short page is the index's end: no round trip to learn it
            if not ids:
                break
            cursor = ids[-1]
            with redis_errors("listing files"):
                # one GET per file in a plain pipeline, not an MGET: each file's keys have its own
                # hash tag, so on a Redis Cluster they sit on different slots (the client splits the
                # pipeline per shard; an MGET across slots is refused)
                pipe = self.redis.pipeline(transaction=False)
                for i in ids:
                    pipe.get(self.keys.file(i))
                values = await pipe.execute()
            gone = [file_id for file_id, raw in zip(ids, values) if raw is None]
            for raw in values:
                if raw is not None:
                    info = FileObject.model_validate_json(raw)
                    if purpose is None or info.purpose == purpose:
                        found.append(info)
            if gone:
                await self._forget(owner, gone)
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
        info = FileObject.model_validate_json(raw)
        if info.expires_at is not None:  # counted in its owner's usage until then
            await self.owners.file_expires(info.owner, info.id, info.expires_at)
        return info

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
        info = await self.get(file_id, owner)
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
        await self._forget(info.owner, [file_id])
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

    def _partial_path(self, file_id: str) -> Path:
        assert self.directory is not None
        return self.directory / f".{file_id}.tmp"

    async def _bound(self, file_id: str, owner: str) -> Callable[[int], None]:
        """What an upload checks before each piece, given its size so far: ``max_bytes``, and its
        owner's quotas (:meth:`OwnerIndex.check_upload`: refused at once when the owner already holds
        its quota of files or bytes)."""
        room = (
            await memory_room(self.redis, self.keys.file_partial(file_id)) if self.directory is None else None
        )
        usage, quota_bytes = await self.owners.check_upload(owner, room)

        def check(size: int) -> None:
            if size > self.max_bytes:
                raise InvalidRequestError(
                    f"the file is larger than this server's limit of {self.max_bytes} bytes", "file"
                )
            self.owners.check_bytes(usage, quota_bytes, size)

        return check

    async def _append_pieces(
        self, file_id: str, pieces: AsyncIterable[bytes], bound: Callable[[int], None] | None
    ) -> int:
        """Append the pieces to the file's partial key (each renewing its TTL); the size stored. An
        upload (``bound`` set: :meth:`_bound`) checks before each piece that it leaves Redis's
        serving reserve alone (:class:`MemoryRoom`); a batch's output files, written for lines
        already run, do not."""
        partial = self.keys.file_partial(file_id)
        size = 0
        check_room = bound is not None
        async for piece in _cut(pieces):
            size += len(piece)
            if bound is not None:
                bound(size)
            if check_room:
                room = await memory_room(self.redis, partial)
                check_room = room is not None  # no maxmemory: nothing to check for this file
                if room is not None and room.room < len(piece):
                    raise room.refuse(f"storing file {file_id} ({size - len(piece)} bytes stored so far)")
            with redis_errors("storing a file"):
                pipe = self.redis.pipeline(transaction=False)
                pipe.append(partial, piece)
                pipe.pexpire(partial, PARTIAL_TTL_S * 1000)
                stored, _ = await pipe.execute()
            if stored != size:  # the key expired (or was deleted) between two pieces
                raise ControlPlaneError(
                    f"Redis lost part of file {file_id} while it was stored (it kept {stored} of "
                    f"{size} bytes: its partial key expired or was deleted); upload it again"
                )
        return size

    async def _write_pieces(
        self, file_id: str, pieces: AsyncIterable[bytes], bound: Callable[[int], None] | None
    ) -> int:
        """Write the pieces to a hidden temporary file in ``directory``, then rename it to the file's
        path (a reader never sees half a file); the size written."""
        assert self.directory is not None
        await asyncio.to_thread(self._sweep)
        tmp = self._partial_path(file_id)
        handle = await asyncio.to_thread(tmp.open, "xb")
        size = 0
        try:
            async for piece in _cut(pieces):
                size += len(piece)
                if bound is not None:
                    bound(size)
                await asyncio.to_thread(handle.write, piece)
        finally:
            handle.close()
        await asyncio.to_thread(os.replace, tmp, self._path(file_id))
        return size

    def _sweep(self) -> None:
        """Make the directory, and delete the temporary files of uploads whose router died (not
        written to for PARTIAL_TTL_S), at most once per PARTIAL_TTL_S."""
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        if now - self._swept_at < PARTIAL_TTL_S:
            return
        self._swept_at = now
        for tmp in self.directory.glob(".file-*.tmp"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > PARTIAL_TTL_S:
                    tmp.unlink()
                    logger.info("deleted %s, left by an upload that stopped", tmp)

    async def _forget(self, owner: str, file_ids: list[str]) -> None:
        """Files deleted or found gone: off their owner's listing and usage."""
        await self.owners.forget_files(owner, file_ids)
        if self.directory is not None:
            for file_id in file_ids:
                with contextlib.suppress(OSError):
                    self._path(file_id).unlink()

    async def _discard(self, file_id: str, owner: str) -> None:
        """Delete whatever storing the file left (an upload that failed or was cancelled)."""
        if self.directory is not None:
            for path in (self._partial_path(file_id), self._path(file_id)):
                with contextlib.suppress(OSError):
                    path.unlink()
        keys = [self.keys.file_partial(file_id), self.keys.file_content(file_id), self.keys.file(file_id)]
        try:
            await self.redis.delete(*keys)  # one slot: the file's hash tag
            await self.owners.forget_files(owner, [file_id])
        except Exception as e:  # the partial key expires anyway; the rest was never written
            logger.warning("file %s: could not delete what its failed upload stored: %r", file_id, e)

    async def _read_key(self, file_id: str, key: str, size: int) -> AsyncIterator[bytes]:
        """The bytes of a file in Redis, CHUNK_BYTES per GETRANGE."""
        offset = 0
        while offset < size:
            with redis_errors("reading a file"):
                piece = cast(
                    bytes, await self.redis.getrange(key, offset, min(offset + CHUNK_BYTES, size) - 1)
                )
            if not piece:
                raise NotFoundError(f"file {file_id} was deleted while it was read", "file_id")
            offset += len(piece)
            yield piece

    async def _read_file(self, file_id: str, path: Path, size: int) -> AsyncIterator[bytes]:
        """The bytes of a file in ``directory``, CHUNK_BYTES per read."""
        try:
            handle = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError:
            raise NotFoundError(f"file {file_id} was deleted while it was read", "file_id") from None
        try:
            offset = 0
            while offset < size:
                piece = await asyncio.to_thread(handle.read, min(CHUNK_BYTES, size - offset))
                if not piece:
                    raise NotFoundError(f"file {file_id} was cut short while it was read", "file_id")
                offset += len(piece)
                yield piece
        finally:
            handle.close()


async def _one(content: bytes) -> AsyncIterator[bytes]:
    yield content


async def _cut(pieces: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """``pieces`` cut to CHUNK_BYTES at most (views: nothing is copied); empty ones dropped."""
    async for piece in pieces:
        if len(piece) <= CHUNK_BYTES:
            if piece:
                yield piece
            continue
        view = memoryview(piece)
        for start in range(0, len(view), CHUNK_BYTES):
            yield cast(bytes, view[start : start + CHUNK_BYTES])
