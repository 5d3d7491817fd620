"""What a batch worker reads again and again: the reaper reads the rq queue once
per pass, and a worker running two batches at once reads and parses each input file once."""

from __future__ import annotations

import asyncio

import redis

from pdserve.batch.input_lines import LINE_OVERHEAD_BYTES, InputLines
from pdserve.batch.reaper import Reaper
from pdserve.batch.runner import BatchRunner
from pdserve.batch.validation import Line
from pdserve.batchstore.batches import BatchObject
from tests.batch_support import batch_with_lines, with_runner

LEASE_TTL_MS = 200


def lrange_calls(redis_url: str) -> int:
    """LRANGEs the server ran since it started (rq reads its queue's job ids with one)."""
    client = redis.Redis.from_url(redis_url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return int(stats.get("cmdstat_lrange", {}).get("calls", 0))


async def chunked(runner: BatchRunner, n: int, done: int, chunk_lines: int) -> BatchObject:
    batch = await batch_with_lines(runner, n, done)
    moved = await runner.batches.update(
        batch.id, ("in_progress",), chunks=-(-n // chunk_lines), chunk_lines=chunk_lines
    )
    assert moved is not None
    return moved


def test_a_reaper_pass_reads_the_queue_once_however_many_chunks(redis_url: str) -> None:
    """Two batches of three chunks: two chunks of each wait in the queue, the third's job is in no
    queue (its worker died). A pass reads the queue's list once, not once per chunk, and what it
    read still tells the waiting chunks (left alone) from the lost ones (enqueued again)."""

    async def main(runner: BatchRunner, reaper: Reaper) -> None:
        batches = [await chunked(runner, 6, 0, 2) for _ in range(2)]
        for batch in batches:
            queued = {k: await asyncio.to_thread(runner.queue.enqueue_chunk, batch.id, k) for k in (0, 1)}
            await runner.batches.set_chunk_jobs(batch.id, {**queued, 2: f"{batch.id}-2-0"})
        before = lrange_calls(redis_url)
        await reaper.one_pass()
        assert lrange_calls(redis_url) - before == 1  # was one per chunk with a job: 6
        await asyncio.sleep(LEASE_TTL_MS / 1000 * 1.5)  # suspected for a lease TTL: lost now
        before = lrange_calls(redis_url)
        await reaper.one_pass()
        assert lrange_calls(redis_url) - before == 1
        for batch in batches:
            jobs = await runner.batches.chunk_jobs(batch.id)
            assert jobs == {0: f"{batch.id}-0-0", 1: f"{batch.id}-1-0", 2: f"{batch.id}-2-1"}
            assert await asyncio.to_thread(runner.queue.waiting, jobs[2])

    with_runner(redis_url, main, lease_ttl_ms=LEASE_TTL_MS)


def test_two_batches_running_together_read_their_input_once_each(redis_url: str) -> None:
    """Chunks of two batches taking turns on one worker: each input file is read (and parsed) once,
    not at every chunk as when the worker kept one batch's lines."""

    async def main(runner: BatchRunner, reaper: Reaper) -> None:
        first, second = [await chunked(runner, 4, 2, 2) for _ in range(2)]  # chunk 0 done: no line to send
        files = runner.files
        real_content = files.content
        reads: list[str] = []

        async def content(file_id: str) -> bytes:
            reads.append(file_id)
            return await real_content(file_id)

        files.content = content  # type: ignore[method-assign]
        for batch in (first, second, first, second, first):
            assert await runner.run_chunk(batch.id, 0, f"{batch.id}-0-0") == "0 of 0 lines run"
        assert sorted(reads) == sorted([first.input_file_id, second.input_file_id])

    with_runner(redis_url, main)


def lines(n: int, body_bytes: int) -> list[Line]:
    return [Line(f"r{i:03d}", "/v1/chat/completions", b"x" * body_bytes, "m") for i in range(n)]


def test_the_input_lines_kept_are_bounded_by_bytes_least_recently_used_first() -> None:
    one = len(lines(1, 1000)[0].custom_id) + 1000 + LINE_OVERHEAD_BYTES
    cache = InputLines(max_bytes=3 * 10 * one)
    for batch_id in ("a", "b", "c"):
        cache.put(batch_id, lines(10, 1000))
    assert cache.bytes == 3 * 10 * one and all(b in cache for b in "abc")
    assert cache.get("a") is not None  # used: "b" is now the least recently used
    cache.put("d", lines(10, 1000))
    assert [b for b in "abcd" if b in cache] == ["a", "c", "d"]
    cache.put("e", lines(100, 1000))  # more than the bound alone: kept, the others dropped
    assert [b for b in "abcde" if b in cache] == ["e"] and cache.bytes == 100 * one
    cache.pop("e")
    assert cache.bytes == 0 and cache.get("e") is None
