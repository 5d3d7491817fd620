"""Finalizing a batch (writing its output files) on a real Redis, with a real BatchRunner and
Reaper in-process: an output larger than the upload limit is stored; a batch whose output cannot be
written stops no other batch's recovery in the reaper's pass, says why on itself while it is tried
again, never fails within its window, and past it fails with the reason after ``MAX_FINALIZE_TRIES``
tries with its outcomes kept, instead of staying ``finalizing`` forever."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from batch_support import batch_with_lines, with_runner

from pdserve.batch import finalize as finalize_module
from pdserve.batch import reaper as reaper_module
from pdserve.batch.finalize import MAX_FINALIZE_TRIES
from pdserve.batch.reaper import Reaper
from pdserve.batch.runner import BatchRunner
from pdserve.batchstore.batches import BatchObject
from pdserve.batchstore.file_object import FileObject
from pdserve.cli_commands import write_batch_output
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
    """Make publishing ``batch_id``'s output files (once its outcomes are moved into them) raise a
    fault (every other batch's works); the times of the tries."""
    tries: list[float] = []
    publish = runner.finalizer.move.publish

    async def publish_or_fail(batch: BatchObject, state: Any) -> Any:
        if batch.id == batch_id:
            tries.append(time.monotonic())
            raise OSError(5, "Input/output error")
        return await publish(batch, state)

    runner.finalizer.move.publish = publish_or_fail  # type: ignore[method-assign]
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


def test_a_batch_that_keeps_failing_to_finalize_fails_with_the_reason_once_its_window_ends(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The chunk job's try, then the reaper's, each put off (FINALIZE_RETRY_S, shortened here)
    with the reason on the batch: within its window it is never failed, however many tries fail;
    past it, the MAX_FINALIZE_TRIES-th fails it with the reason, and its outcomes are kept, which
    ``pdserve status --batch-output`` writes out."""
    monkeypatch.setattr(reaper_module, "FINALIZING_GRACE_S", 0.2)
    monkeypatch.setattr(finalize_module, "FINALIZE_RETRY_S", 0.1)

    async def main(
        runner: BatchRunner, reaper: Reaper
    ) -> tuple[BatchObject, BatchObject, list[float], list[str]]:
        store = runner.batches
        batch = await batch_with_lines(runner, 2, 2)
        tries = failing_output(runner, batch.id)
        await runner.maybe_finalize(batch.id)  # the chunk job that wrote the last line
        deadline = time.monotonic() + 20
        while len(tries) < MAX_FINALIZE_TRIES + 2:
            assert time.monotonic() < deadline, f"{len(tries)} tries"
            await reaper.one_pass()
            await asyncio.sleep(0.05)
        waiting = await store.get(batch.id)
        assert await store.update(batch.id, ("finalizing",), expires_at=int(time.time()) - 1)
        while (await store.get(batch.id)).status == "finalizing":
            assert time.monotonic() < deadline, f"still finalizing after {len(tries)} tries"
            await reaper.one_pass()
            await asyncio.sleep(0.05)
        for _ in range(3):  # a failed batch is left alone
            await reaper.one_pass()
        files, _ = await runner.files.list_files(purpose="batch_output")
        cluster = runner.settings.router.cluster
        assert await write_batch_output(redis_url, cluster, batch.id, tmp_path) == 0
        return waiting, await store.get(batch.id), tries, [f.id for f in files]

    waiting, batch, tries, outputs = with_runner(redis_url, main)
    exported = (tmp_path / f"{batch.id}_output.jsonl").read_bytes().splitlines()
    assert [orjson.loads(line)["custom_id"] for line in exported] == ["req-0", "req-1"]  # kept, retrievable
    assert (tmp_path / f"{batch.id}_error.jsonl").read_bytes() == b""
    assert waiting.status == "finalizing" and waiting.errors is not None, waiting
    assert waiting.errors.data[0].code == "finalize_retrying", waiting.errors
    assert (
        "Input/output error" in waiting.errors.data[0].message
        and "nothing is lost" in waiting.errors.data[0].message
    )
    assert waiting.request_counts.completed == 2
    assert batch.status == "failed" and batch.failed_at is not None, batch
    assert len(tries) == MAX_FINALIZE_TRIES + 3
    assert all(b - a >= 0.08 for a, b in itertools.pairwise(tries[1:])), tries  # put off each time
    assert batch.errors is not None and len(batch.errors.data) == 1
    error = batch.errors.data[0]
    assert error.code == "finalize_failed" and "Input/output error" in error.message, error
    assert f"pdserve status --batch-output {batch.id}" in error.message, error
    assert batch.output_file_id is None and batch.error_file_id is None and outputs == []
    assert batch.request_counts.completed == 2  # its outcomes are kept


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
