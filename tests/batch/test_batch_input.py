"""A batch's input file and its validation, on a real Redis with a real BatchRunner and Reaper
in-process: a batch that loses its input file fails with the reason (it does not stay
``in_progress``); validation waits for a live instance within the window, expires with it, and
checks the lines off the event loop so that its lease keeps being renewed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest
import redis
from batch_support import CHAT, batch_with_lines, with_runner
from router_support import instance

from pdserve.batch import runner as runner_module
from pdserve.batch.reaper import Reaper
from pdserve.batch.runner import VALIDATION_CHUNK, BatchRunner
from pdserve.batchstore.batches import BatchObject
from pdserve.scheduler.registry import InstanceRegistry


async def validating(runner: BatchRunner, n: int = 2, window: str = "1h") -> BatchObject:
    """A batch ``validating`` with ``n`` valid lines for the model ``tiny``."""
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": CHAT,
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        }
        for i in range(n)
    ]
    file = await runner.files.create("in.jsonl", "batch", b"\n".join(map(orjson.dumps, lines)) + b"\n")
    return await runner.batches.create(file.id, CHAT, window, None)


async def register_instance(runner: BatchRunner) -> None:
    await InstanceRegistry(runner.batches.redis, runner.batches.keys).register(instance("m1"))


def error_codes(batch: BatchObject) -> list[str]:
    return [e.code for e in batch.errors.data] if batch.errors else []


# ---- losing the input file ----------------------------------------------------------------------
def test_a_chunk_whose_input_file_is_gone_fails_the_batch(redis_url: str) -> None:
    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[str, BatchObject, list[str]]:
        batch = await batch_with_lines(runner, 3, 1)
        assert await runner.batches.update(batch.id, ("in_progress",), chunks=1, chunk_lines=3)
        await runner.files.delete(batch.input_file_id)  # by hand, past the router's 409
        outcome = await runner.run_chunk(batch.id, 0, "job-0")
        return outcome, await runner.batches.get(batch.id), await runner.batches.active()

    outcome, batch, active = with_runner(redis_url, main, timeout_s=30)
    assert "input file is gone" in outcome
    assert batch.status == "failed" and batch.failed_at is not None, batch
    assert error_codes(batch) == ["input_file_missing"] and active == []
    assert batch.output_file_id is not None  # the line that ran is kept


def test_an_expiring_batch_whose_input_file_is_gone_fails_with_the_reason(redis_url: str) -> None:
    """Its unfinished lines' error records need their custom_id, from the input file."""

    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[BatchObject, list[str]]:
        batch = await batch_with_lines(runner, 3, 1)
        assert await runner.batches.update(batch.id, ("in_progress",), expires_at=int(time.time()) - 1)
        await runner.files.delete(batch.input_file_id)
        await reaper.one_pass()
        return await runner.batches.get(batch.id), await runner.batches.active()

    batch, active = with_runner(redis_url, main, timeout_s=30)
    assert batch.status == "failed" and error_codes(batch) == ["input_file_missing"], batch
    assert active == [] and batch.output_file_id is not None


# ---- validation ---------------------------------------------------------------------------------
def test_validation_waits_for_a_live_instance(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module, "VALIDATION_POLL_S", 0.05)

    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[str, str, BatchObject]:
        batch = await validating(runner)
        job = asyncio.create_task(runner.validate(batch.id, f"{batch.id}-validate"))
        await asyncio.sleep(0.5)
        assert not job.done(), job.result()
        waiting = (await runner.batches.get(batch.id)).status
        await register_instance(runner)
        outcome = await asyncio.wait_for(job, 10)
        return waiting, outcome, await runner.batches.get(batch.id)

    waiting, outcome, batch = with_runner(redis_url, main, timeout_s=30)
    assert waiting == "validating" and outcome == "validated"
    assert batch.status == "in_progress" and batch.request_counts.total == 2, batch


def test_a_validation_waiting_past_the_window_expires_the_batch(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "VALIDATION_POLL_S", 0.05)

    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[str, BatchObject, list[str]]:
        batch = await validating(runner, window="1s")
        outcome = await asyncio.wait_for(runner.validate(batch.id, f"{batch.id}-validate"), 5)
        return outcome, await runner.batches.get(batch.id), await runner.batches.active()

    outcome, batch, active = with_runner(redis_url, main, timeout_s=30)
    assert outcome == "stopped waiting for a live instance"
    assert batch.status == "expired" and batch.expired_at is not None, batch
    assert error_codes(batch) == ["batch_expired"] and active == []


def test_the_reaper_expires_a_batch_still_validating_at_its_windows_end(redis_url: str) -> None:
    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[BatchObject, list[str]]:
        batch = await validating(runner)
        assert await runner.batches.update(batch.id, ("validating",), expires_at=int(time.time()) - 1)
        await reaper.one_pass()
        return await runner.batches.get(batch.id), await runner.batches.active()

    batch, active = with_runner(redis_url, main, timeout_s=30)
    assert batch.status == "expired" and error_codes(batch) == ["batch_expired"], batch
    assert active == []


def test_checking_the_lines_leaves_the_event_loop_free_to_renew_the_lease(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check that takes 2.5 lease TTLs (a large file): the lease must still be held at its end,
    or the reaper would give the validation to a second job."""
    check_lines = runner_module.check_lines
    held: list[bool] = []
    sync = redis.Redis.from_url(redis_url)

    def slow_check(content: bytes, live: Any, limits: Any, max_lines: int) -> Any:
        time.sleep(1.0)
        held.append(bool(sync.exists(lease_key[0])))
        return check_lines(content, live, limits, max_lines)

    monkeypatch.setattr(runner_module, "check_lines", slow_check)
    lease_key: list[str] = []

    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[str, BatchObject]:
        await register_instance(runner)
        batch = await validating(runner)
        lease_key.append(runner.batches.keys.batch_lease(batch.id, VALIDATION_CHUNK))
        outcome = await runner.validate(batch.id, f"{batch.id}-validate")
        return outcome, await runner.batches.get(batch.id)

    try:
        outcome, batch = with_runner(redis_url, main, timeout_s=30, lease_ttl_ms=400)
    finally:
        sync.close()
    assert outcome == "validated" and batch.status == "in_progress", batch
    assert held == [True]
