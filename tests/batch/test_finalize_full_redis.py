"""Finalizing a batch in a Redis at a small ``maxmemory`` (``noeviction``, as the shipped
deployments run it), with a real BatchRunner and Reaper in-process: a completed batch whose output
would not fit beside its outcomes is written by moving them (no moment holds both whole); one that
finds Redis too full to take a step waits, says so on the batch, loses nothing, and completes once
room returns, every line once. Before, the output was a copy: its write raised, counted as a failed
try, and after three the batch was ``failed`` with no output and its outcomes in a hash no API read."""

from __future__ import annotations

import asyncio
import contextlib
import time

import orjson
import pytest
import redis
from batch_support import batch_with_lines, with_runner

from pdserve.batch import finalize as finalize_module
from pdserve.batch import reaper as reaper_module
from pdserve.batch.reaper import Reaper
from pdserve.batch.runner import BatchRunner
from pdserve.batchstore.batches import BatchObject
from pdserve.errors import ControlPlaneFullError, PdserveError
from pdserve.localredis.embedded import EmbeddedRedis

LINES = 1200
TEXT = "x" * 8000  # each outcome ~8 kB: the outcomes ~10 MB
MIB = 1 << 20


async def finalize_until_final(
    runner: BatchRunner, reaper: Reaper, batch_id: str, seconds: float
) -> list[str]:
    """The chunk job's try, then the reaper's passes until the batch is final or ``seconds`` pass;
    what the chunk job's try raised (a finalization that waits raises nothing). A pass that cannot
    take the reaper's lock (Redis takes no write) is skipped, as ``Reaper.run`` skips it."""
    raised: list[str] = []
    try:
        await runner.maybe_finalize(batch_id)
    except PdserveError as e:
        raised.append(f"{type(e).__name__}: {e.message}")
    deadline = time.monotonic() + seconds
    while not (await runner.batches.get(batch_id)).final and time.monotonic() < deadline:
        with contextlib.suppress(ControlPlaneFullError):
            await reaper.one_pass()
        await asyncio.sleep(0.05)
    return raised


async def output_lines(runner: BatchRunner, batch: BatchObject) -> list[str]:
    """The custom ids of the batch's output file, in order (none without one)."""
    if batch.output_file_id is None:
        return []
    content = await runner.files.content(batch.output_file_id)
    return [orjson.loads(line)["custom_id"] for line in content.splitlines()]


@pytest.fixture
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reaper_module, "FINALIZING_GRACE_S", 0.2)
    monkeypatch.setattr(finalize_module, "FINALIZE_RETRY_S", 0.1)
    monkeypatch.setattr(finalize_module, "FINALIZE_RETRY_MAX_S", 0.2)


def test_an_output_that_would_not_fit_beside_its_outcomes_is_moved(
    private_redis: EmbeddedRedis, short_waits: None
) -> None:
    """~10 MB of outcomes, 6 MiB of room under maxmemory (Redis deep in its serving reserve): a
    copy of the outcomes cannot be written, a move can."""
    admin = redis.Redis.from_url(private_redis.url)

    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[BatchObject, list[str], list[str], int]:
        batch = await batch_with_lines(runner, LINES, LINES, text=TEXT)
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", used + 6 * MIB)
        admin.config_resetstat()  # the peak from here
        raised = await finalize_until_final(runner, reaper, batch.id, 30)
        peak = int(admin.info("memory")["used_memory_peak"])
        print(
            f"outcomes {LINES * len(TEXT) / MIB:.1f} MiB; peak {(peak - used) / MIB:.1f} MiB above the start"
        )
        admin.config_set("maxmemory", 0)
        batch = await runner.batches.get(batch.id)
        left = admin.hlen(runner.batches.keys.batch_results(batch.id))
        return batch, await output_lines(runner, batch), raised, left

    try:
        batch, lines, raised, left = with_runner(private_redis.url, main, timeout_s=90)
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
    assert batch.status == "completed" and raised == [], (batch.status, batch.errors, raised)
    assert lines == [f"req-{i}" for i in range(LINES)]  # every line, once, in order
    assert batch.request_counts.completed == LINES and batch.errors is None
    assert left == 0  # its outcomes left the hash as they went into the file


def test_a_batch_waits_for_room_and_completes_when_it_returns(
    private_redis: EmbeddedRedis, short_waits: None
) -> None:
    """Too little room for a step (1 MiB): the batch waits, ``finalizing``, saying why; then Redis
    is full to its maxmemory (no write at all): it still waits, nothing lost; room returns: it
    completes, every line once."""
    admin = redis.Redis.from_url(private_redis.url)

    async def main(
        runner: BatchRunner, reaper: Reaper
    ) -> tuple[BatchObject, BatchObject, BatchObject, list[str], list[str]]:
        batch = await batch_with_lines(runner, LINES, LINES, text=TEXT)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + MIB)
        raised = await finalize_until_final(runner, reaper, batch.id, 2)
        nearly_full = await runner.batches.get(batch.id)
        admin.config_set("maxmemory", MIB)  # below what it holds: every write refused
        raised += await finalize_until_final(runner, reaper, batch.id, 2)
        full = await runner.batches.get(batch.id)
        admin.config_set("maxmemory", 0)  # room again (files deleted, or maxmemory raised)
        raised += await finalize_until_final(runner, reaper, batch.id, 30)
        batch = await runner.batches.get(batch.id)
        return nearly_full, full, batch, raised, await output_lines(runner, batch)

    try:
        nearly_full, full, batch, raised, lines = with_runner(private_redis.url, main, timeout_s=90)
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
    assert raised == [], raised  # a wait is no failed try
    for waiting in (nearly_full, full):
        assert waiting.status == "finalizing", waiting
        assert waiting.request_counts.completed == LINES  # nothing lost meanwhile
    assert nearly_full.errors is not None, nearly_full  # the reason, on the batch
    reason = nearly_full.errors.data[0]
    assert reason.code == "control_plane_full" and "Redis is nearly full" in reason.message, reason
    assert "nothing is lost" in reason.message
    assert batch.status == "completed" and batch.errors is None, (batch.status, batch.errors)
    assert lines == [f"req-{i}" for i in range(LINES)]
