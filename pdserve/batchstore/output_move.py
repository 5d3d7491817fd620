"""Moving a batch's outcomes into its output and error files, a piece at a time, so that Redis never
holds both whole: a piece of lines is appended to each file's partial key, then those lines leave
the outcome hashes. Writing the files as a copy needed room for the outcomes' size again, which a
nearly full Redis has not (a batch worker's output may use the serving reserve, but a 40 MiB output
did not fit a 128 MB Redis's); moving needs about one piece of room, whatever the batch's size.

Every step can be repeated, by the same finalization after a failure or by another one at the same
time (the chunk job that wrote the last line and the reaper), and moves each line once:

- where the move stands (the next line, the bytes in each file, their ids, the counts when it began)
  is in the batch's ``…:finalize`` hash, set once by :data:`_BEGIN`;
- a piece is appended by :data:`_ENSURE`, which makes bytes ``[offset, offset + len)`` of a file's
  partial key the piece, appending only what is missing (so a repeated or overlapping append adds
  nothing) and refusing where the key holds other bytes;
- :data:`_ADVANCE` moves the cursor past the piece's lines and deletes them from the hashes only if
  the cursor is still where the piece began: the step's commit. A finalization that finds it moved
  reads the state again.

The partial keys have no TTL while the move runs (``PARTIAL_TTL_S`` would lose moved lines); once
the last line is moved each becomes its file (``FileStore.publish``). With ``--files-dir`` the bytes
go to disk and nothing needs moving (:meth:`OutputMove.write_to_files_dir`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import cast

from pdserve.batchstore.batches import BatchObject, BatchStore
from pdserve.batchstore.file_object import FileObject, new_id
from pdserve.batchstore.files import CHUNK_BYTES, FileStore
from pdserve.errors import PdserveError
from pdserve.scheduler.redis_server import memory_room, redis_errors

logger = logging.getLogger(__name__)

MOVE_PIECE_BYTES = 256 << 10
"""About how many bytes of lines one step moves: while it runs Redis holds the piece up to four
times over (the reply that reads it, the command that appends it, its place in the file, the lines
not yet deleted)."""
MOVE_HEADROOM_BYTES = 2 << 20
"""Room a move needs under Redis's ``maxmemory`` to take a step: a step's copies of its piece, and a
growing string's spare allocation (up to 1 MiB past its length)."""
MOVE_LINES = (16, 4096)
"""Lines per step: the first step's, and the most; in between, about MOVE_PIECE_BYTES of lines."""

# KEYS[1] the batch's finalize hash, KEYS[2] its outcomes, KEYS[3] its errors; ARGV[1], ARGV[2] the
# ids the output and error files get if the move begins now. Where the move stands.
_BEGIN = """
if redis.call('HEXISTS', KEYS[1], 'line') == 0 then
  redis.call('HSET', KEYS[1], 'line', 0, 'out_file', ARGV[1], 'err_file', ARGV[2], 'out_bytes', 0,
             'err_bytes', 0, 'completed', redis.call('HLEN', KEYS[2]), 'failed', redis.call('HLEN', KEYS[3]))
end
return redis.call('HMGET', KEYS[1], 'line', 'out_file', 'err_file', 'out_bytes', 'err_bytes', 'completed', 'failed')
"""

# KEYS[1] a file's partial key; ARGV[1] an offset, ARGV[2] a piece. Makes bytes [offset, offset +
# #piece) the piece, appending what is missing of it: 1; 0 when the key holds other bytes there.
_ENSURE = """
local offset = tonumber(ARGV[1])
local piece = ARGV[2]
local have = redis.call('STRLEN', KEYS[1]) - offset
if have < 0 then return 0 end
if have > 0 then
  local n = math.min(have, #piece)
  if redis.call('GETRANGE', KEYS[1], offset, offset + n - 1) ~= string.sub(piece, 1, n) then return 0 end
  if have >= #piece then return 1 end
  piece = string.sub(piece, have + 1)
end
redis.call('APPEND', KEYS[1], piece)
return 1
"""

# KEYS as _BEGIN's; ARGV[1] the line the step began at, ARGV[2] the next one, ARGV[3], ARGV[4] the
# bytes of the output and error files after the step, ARGV[5..] its lines. 1 when the step is
# committed (its lines leave the hashes), 0 when another finalization moved on first. The deletes
# come first: a script that has deleted may write on at maxmemory.
_ADVANCE = """
if redis.call('HGET', KEYS[1], 'line') ~= ARGV[1] then return 0 end
for i = 5, #ARGV do
  redis.call('HDEL', KEYS[2], ARGV[i])
  redis.call('HDEL', KEYS[3], ARGV[i])
end
redis.call('HSET', KEYS[1], 'line', ARGV[2], 'out_bytes', ARGV[3], 'err_bytes', ARGV[4])
return 1
"""


@dataclasses.dataclass(frozen=True)
class MoveState:
    """Where a batch's move stands (its ``…:finalize`` hash)."""

    line: int
    out_file: str
    err_file: str
    out_bytes: int
    err_bytes: int
    completed: int
    failed: int
    """The batch's counts when the move began (its hashes shrink as it goes)."""


class OutputMove:
    """Write a batch's output and error files from its outcome hashes (Redis: moved; a folder: copied)."""

    def __init__(self, batches: BatchStore, files: FileStore) -> None:
        self.batches = batches
        self.files = files
        self.redis = batches.redis
        self.keys = batches.keys
        self._begin = self.redis.register_script(_BEGIN)
        self._ensure = self.redis.register_script(_ENSURE)
        self._advance = self.redis.register_script(_ADVANCE)

    def _batch_keys(self, batch_id: str) -> list[str]:
        k = self.keys
        return [k.batch_finalize(batch_id), k.batch_results(batch_id), k.batch_errors(batch_id)]

    async def check_room(self, batch_id: str) -> None:
        """ControlPlaneFullError when the Redis holding the batch has less than MOVE_HEADROOM_BYTES
        under its ``maxmemory``: a step would fail, and so may the small writes around it."""
        room = await memory_room(self.redis, self.keys.batch(batch_id))
        if room is not None and room.maxmemory - room.used < MOVE_HEADROOM_BYTES:
            raise room.refuse(f"writing batch {batch_id}'s output files (it waits for room, losing nothing)")

    async def state(self, batch_id: str) -> MoveState | None:
        """Where the batch's move stands; None before it began."""
        with redis_errors("reading a batch's output move"):
            raw = cast(
                list[bytes | None],
                await self.redis.hmget(
                    self.keys.batch_finalize(batch_id),
                    ["line", "out_file", "err_file", "out_bytes", "err_bytes", "completed", "failed"],
                ),
            )
        return _state(raw) if raw[0] is not None else None

    async def move(self, batch: BatchObject) -> MoveState:
        """Move every outcome of ``batch`` (``total`` lines) into its files' partial keys; where the
        move stands at its end (its files are not published yet: :meth:`publish`). Raises
        ControlPlaneFullError, before a step, when Redis has no room for one; what was moved stays."""
        await self.check_room(batch.id)
        with redis_errors("beginning a batch's output move"):
            raw = await self._begin(keys=self._batch_keys(batch.id), args=[new_id("file-"), new_id("file-")])
        state = _state(raw)
        lines, total = MOVE_LINES[0], batch.request_counts.total
        moved_lines = moved_bytes = 0
        while state.line < total:
            await self.check_room(batch.id)
            end = min(state.line + lines, total)
            numbers = list(range(state.line, end))
            with redis_errors("reading a batch's lines"):
                pipe = self.redis.pipeline(transaction=False)
                pipe.hmget(self.keys.batch_results(batch.id), numbers)
                pipe.hmget(self.keys.batch_errors(batch.id), numbers)
                outs, errs = await pipe.execute()
            out = b"".join(v + b"\n" for v in outs if v is not None)
            err = b"".join(v + b"\n" for v in errs if v is not None)
            if await self._append(state.out_file, state.out_bytes, out) and await self._append(
                state.err_file, state.err_bytes, err
            ):
                args = [state.line, end, state.out_bytes + len(out), state.err_bytes + len(err), *numbers]
                with redis_errors("moving a batch's lines"):
                    await self._advance(keys=self._batch_keys(batch.id), args=args)
                moved_lines, moved_bytes = moved_lines + len(numbers), moved_bytes + len(out) + len(err)
                lines = max(1, min(MOVE_LINES[1], MOVE_PIECE_BYTES * moved_lines // max(moved_bytes, 1)))
            before, state = state, await self.state(batch.id) or state  # committed, or another moved on
            if state == before:  # a file holds other bytes than the move recorded, and none moved on
                raise PdserveError(f"batch {batch.id}'s output files do not hold what its move recorded")
        return state

    async def _append(self, file_id: str, offset: int, piece: bytes) -> bool:
        """Make ``piece`` the bytes of ``file_id``'s partial key at ``offset``, CHUNK_BYTES per
        command; False when the key holds other bytes there (another finalization moved on)."""
        key = self.keys.file_partial(file_id)
        for start in range(0, len(piece), CHUNK_BYTES):
            with redis_errors("moving a batch's lines"):
                if not await self._ensure(
                    keys=[key], args=[offset + start, piece[start : start + CHUNK_BYTES]]
                ):
                    return False
        return True

    async def publish(self, batch: BatchObject, state: MoveState) -> dict[str, str | None]:
        """Make the moved bytes the batch's output and error files (its owner's; none for no bytes):
        ``{"output_file_id", "error_file_id"}``. Publishing twice publishes once."""
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for field, file_id, size, name in (
            ("output_file_id", state.out_file, state.out_bytes, "output"),
            ("error_file_id", state.err_file, state.err_bytes, "error"),
        ):
            if size:
                filename = f"{batch.id}_{name}.jsonl"
                info = await self.files.publish(file_id, filename, "batch_output", size, batch.owner)
                ids[field] = info.id
        return ids

    async def keep(self, batch_id: str, ttl_s: int) -> None:
        """A move that will not finish (its batch failed): its partial keys expire with the batch."""
        state = await self.state(batch_id)
        if state is not None:
            with redis_errors("keeping a batch's outcomes"):
                for file_id in (state.out_file, state.err_file):
                    await self.redis.expire(self.keys.file_partial(file_id), ttl_s)

    async def write_to_files_dir(self, batch: BatchObject) -> tuple[dict[str, str | None], int, int]:
        """With ``--files-dir``: the output and error files written to the folder from the outcome
        hashes, read a page at a time (nothing moves: the hashes are deleted with the batch's end);
        ``(ids, completed, failed)``."""
        counts = {"out": 0, "err": 0}

        async def lines(kind: str) -> AsyncIterator[bytes]:
            key = self.keys.batch_results(batch.id) if kind == "out" else self.keys.batch_errors(batch.id)
            for start in range(0, batch.request_counts.total, MOVE_LINES[1]):
                numbers = list(range(start, min(start + MOVE_LINES[1], batch.request_counts.total)))
                with redis_errors("reading a batch's lines"):
                    values = cast(list[bytes | None], await self.redis.hmget(key, numbers))
                found = [v + b"\n" for v in values if v is not None]
                counts[kind] += len(found)
                if found:
                    yield b"".join(found)

        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for field, kind, name in (("output_file_id", "out", "output"), ("error_file_id", "err", "error")):
            info: FileObject = await self.files.store(
                f"{batch.id}_{name}.jsonl", "batch_output", lines(kind), batch.owner
            )
            if info.bytes:
                ids[field] = info.id
            else:
                await self.files.delete(info.id)
        return ids, counts["out"], counts["err"]

    async def outcomes(self, batch_id: str, kind: str, total: int) -> AsyncIterator[bytes]:
        """The JSON lines of a batch's output (``out``) or error (``err``) file as they stand, in
        line order, however far its move went: the moved ones from its file (published or not),
        then those still in its hashes. How an operator reads the outcomes of a batch whose files
        could not be written (``pdserve status --batch-output``)."""
        state = await self.state(batch_id)
        start = 0
        if state is not None:
            file_id = state.out_file if kind == "out" else state.err_file
            for key in (self.keys.file_partial(file_id), self.keys.file_content(file_id)):
                offset = 0
                while True:
                    with redis_errors("reading a batch's outcomes"):
                        piece = cast(bytes, await self.redis.getrange(key, offset, offset + CHUNK_BYTES - 1))
                    if not piece:
                        break
                    offset += len(piece)
                    yield piece
            start = state.line
        key = self.keys.batch_results(batch_id) if kind == "out" else self.keys.batch_errors(batch_id)
        for first in range(start, total, MOVE_LINES[1]):
            numbers = list(range(first, min(first + MOVE_LINES[1], total)))
            with redis_errors("reading a batch's outcomes"):
                values = cast(list[bytes | None], await self.redis.hmget(key, numbers))
            found = b"".join(v + b"\n" for v in values if v is not None)
            if found:
                yield found


def _state(raw: list[bytes | None]) -> MoveState:
    line, out_file, err_file, out_bytes, err_bytes, completed, failed = raw
    assert out_file is not None and err_file is not None
    return MoveState(
        int(line or 0),
        out_file.decode(),
        err_file.decode(),
        int(out_bytes or 0),
        int(err_bytes or 0),
        int(completed or 0),
        int(failed or 0),
    )
