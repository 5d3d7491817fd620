"""Finalizing a batch (writing its output files) on a real Redis, with a real BatchRunner and
Reaper in-process: an output larger than the upload limit is stored; a batch whose output cannot be
written stops no other batch's recovery in the reaper's pass, and fails with the reason after
``MAX_FINALIZE_TRIES`` tries instead of staying ``finalizing`` forever."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import orjson
import pytest
from batch_support import batch_with_lines, with_runner

from pdserve.batch import reaper as reaper_module
from pdserve.batch import runner as runner_module
from pdserve.batch.reaper import Reaper
from pdserve.batch.runner import MAX_FINALIZE_TRIES, BatchRunner
from pdserve.batchstore.batches import BatchObject
from pdserve.batchstore.files import FileObject
from pdserve.errors import NotFoundError

MAX_FILE_BYTES = 2000


@pytest.mark.parametrize("in_folder", [False, True])
def test_an_output_three_times_the_upload_limit_is_stored(
    redis_url: str, tmp_path: Path, in_folder: bool
) -> None:
    """``--max-file-bytes`` bounds uploads, not the output files a batch worker writes."""
    flags = ["--max-file-bytes", str(MAX_FILE_BYTES)] + (["--files-dir", str(tmp_path)] if in_folder else [])

    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[BatchObject, bytes, FileObject]:
        batch = await batch_with_lines(runner, 10, 10, text="x" * 700)  # its input: 1 kB
        await runner.maybe_finalize(batch.id)
        batch = await runner.batches.get(batch.id)
        assert batch.output_file_id is not None, batch
        info = await runner.files.get(batch.output_file_id)
        return batch, await runner.files.content(info.id), info

    batch, content, info = with_runner(redis_url, main, *flags)
    assert batch.status == "completed"
    assert info.bytes == len(content) > 3 * MAX_FILE_BYTES and info.purpose == "batch_output"
    assert [orjson.loads(line)["custom_id"] for line in content.splitlines()] == [
        f"req-{i}" for i in range(10)
    ]
    assert (tmp_path / f"{info.id}.jsonl").exists() == in_folder


def failing_output(runner: BatchRunner, batch_id: str) -> list[float]:
    """Make writing ``batch_id``'s output files raise (every other batch's works); the times of the tries."""
    tries: list[float] = []
    create = runner.files.create

    async def create_or_fail(filename: str, purpose: str, content: bytes, owner: str = "") -> FileObject:
        if filename.startswith(batch_id):
            tries.append(time.monotonic())
            raise OSError(28, "No space left on device")
        return await create(filename, purpose, content, owner)

    runner.files.create = create_or_fail  # type: ignore[method-assign]
    return tries


def test_a_batch_that_cannot_finalize_stops_no_other_in_the_reapers_pass(redis_url: str) -> None:
    """The batch whose output cannot be written is the first the pass meets (the pass goes through
    the active batches in id order); a cancelled one and an expired one after it still end."""

    async def main(runner: BatchRunner, reaper: Reaper) -> list[BatchObject]:
        store = runner.batches
        made = sorted([await batch_with_lines(runner, 3, 1) for _ in range(3)], key=lambda b: b.id)
        stuck, cancelled, expired = made
        failing_output(runner, stuck.id)
        assert await store.update(stuck.id, ("in_progress",), status="finalizing", finalizing_at=1)
        assert await store.update(cancelled.id, ("in_progress",), status="cancelling", cancelling_at=1)
        assert await store.update(expired.id, ("in_progress",), expires_at=int(time.time()) - 1)
        assert await store.active() == [b.id for b in made]
        await reaper.one_pass()
        return [await store.get(b.id) for b in made]

    stuck, cancelled, expired = with_runner(redis_url, main)
    assert stuck.status == "finalizing"  # tried once: MAX_FINALIZE_TRIES - 1 tries left
    assert cancelled.status == "cancelled" and cancelled.output_file_id is not None
    assert expired.status == "expired" and expired.error_file_id is not None


def test_a_batch_that_keeps_failing_to_finalize_fails_with_the_reason(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk job's try, then the reaper's: each after FINALIZING_GRACE_S (a crash's), then
    FINALIZE_RETRY_S; the last one fails the batch (shortened here to keep the test quick)."""
    monkeypatch.setattr(reaper_module, "FINALIZING_GRACE_S", 0.2)
    monkeypatch.setattr(runner_module, "FINALIZE_RETRY_S", 0.3)

    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[BatchObject, list[float], list[str]]:
        store = runner.batches
        batch = await batch_with_lines(runner, 2, 2)
        tries = failing_output(runner, batch.id)
        with pytest.raises(OSError):
            await runner.maybe_finalize(batch.id)  # the chunk job that wrote the last line
        assert (await store.get(batch.id)).status == "finalizing"
        deadline = time.monotonic() + 20
        while (await store.get(batch.id)).status == "finalizing":
            assert time.monotonic() < deadline, f"still finalizing after {len(tries)} tries"
            await reaper.one_pass()
            await asyncio.sleep(0.05)
        for _ in range(3):  # a failed batch is left alone
            await reaper.one_pass()
        files, _ = await runner.files.list_files(purpose="batch_output")
        return await store.get(batch.id), tries, [f.id for f in files]

    batch, tries, outputs = with_runner(redis_url, main)
    assert batch.status == "failed" and batch.failed_at is not None, batch
    assert len(tries) == MAX_FINALIZE_TRIES
    # the reaper's tries wait FINALIZE_RETRY_S after a failure (its first one waits out
    # FINALIZING_GRACE_S from finalizing_at, whole seconds: no bound on that gap here)
    assert all(b - a >= 0.25 for a, b in itertools.pairwise(tries[1:])), tries
    assert batch.errors is not None and len(batch.errors.data) == 1
    error = batch.errors.data[0]
    assert error.code == "finalize_failed" and "No space left on device" in error.message, error
    assert f"{MAX_FINALIZE_TRIES} tries" in error.message
    assert batch.output_file_id is None and batch.error_file_id is None and outputs == []


@pytest.mark.parametrize("concurrently", [True, False])
def test_a_batch_finalized_twice_keeps_one_set_of_files(redis_url: str, concurrently: bool) -> None:
    """Two finalizations of one batch (the chunk job that wrote its last line and the reaper finding
    it left ``finalizing``, say), at once or one after the other: one writes the output file, the
    other leaves none behind."""

    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[BatchObject, list[str]]:
        store = runner.batches
        batch = await batch_with_lines(runner, 3, 3)
        assert await store.update(batch.id, ("in_progress",), status="finalizing", finalizing_at=1)
        if concurrently:
            await asyncio.gather(*(runner.finish(batch.id, "finalizing", "completed") for _ in range(2)))
        else:
            await runner.finish(batch.id, "finalizing", "completed")
            await runner.finish(batch.id, "finalizing", "completed")
        files, _ = await runner.files.list_files(purpose="batch_output")
        return await store.get(batch.id), [f.id for f in files]

    batch, outputs = with_runner(redis_url, main)
    assert batch.status == "completed" and batch.error_file_id is None
    assert outputs == [batch.output_file_id], (outputs, batch.output_file_id)


def test_a_batchs_output_files_are_its_owners(redis_url: str) -> None:
    """The output and error files a batch worker writes belong to the tenant that made the batch
    (only that API key reads them), not to the anonymous owner of an unkeyed batch worker."""
    owner = "0123456789abcdef0123456789abcdef"

    async def main(runner: BatchRunner, reaper: Reaper) -> None:
        line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m"}}
        file = await runner.files.create("in.jsonl", "batch", orjson.dumps(line) + b"\n", owner)
        batch = await runner.batches.create(file.id, "/v1/completions", "24h", None, owner=owner)
        assert await runner.batches.update(batch.id, ("validating",), status="in_progress", total=2, chunks=0)
        for i, error in ((0, False), (1, True)):
            assert await runner.batches.record(batch.id, i, {"custom_id": str(i)}, error)
        await runner.maybe_finalize(batch.id)
        batch = await runner.batches.get(batch.id, owner)
        assert batch.status == "completed" and batch.output_file_id and batch.error_file_id, batch
        for file_id in (batch.output_file_id, batch.error_file_id):
            assert (await runner.files.get(file_id, owner)).owner == owner
            with pytest.raises(NotFoundError):
                await runner.files.get(file_id, "")
        assert [f.id for f in (await runner.files.list_files("batch_output", owner=""))[0]] == []

    with_runner(redis_url, main)
