"""A validation that raises, run by a real rq worker on a real Redis, with the reaper in-process:
whatever one line raises is that line's error (the batch fails naming it, the job runs once), and
a validation job that keeps failing ends its batch ``failed`` with the reason after
MAX_VALIDATION_FAILURES jobs, instead of being run again every lease TTL until the window ends."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from batch_support import CHAT, with_runner, work_queue
from router_support import instance

from pdserve.batch import runner as runner_module
from pdserve.batch.reaper import Reaper
from pdserve.batch.runner import MAX_VALIDATION_FAILURES, BatchRunner
from pdserve.batchstore.batches import BatchObject
from pdserve.scheduler.registry import InstanceRegistry

LEASE_TTL_MS = 200
GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def queued_batch(runner: BatchRunner, bodies: list[bytes]) -> BatchObject:
    """A batch of one line per body, ``validating``, its validation job queued as the router queues it."""
    await InstanceRegistry(runner.batches.redis, runner.batches.keys).register(instance("m1"))
    lines = [
        b'{"custom_id": "req-%d", "method": "POST", "url": "%s", "body": %s}' % (i, CHAT.encode(), body)
        for i, body in enumerate(bodies)
    ]
    file = await runner.files.create("in.jsonl", "batch", b"\n".join(lines) + b"\n")
    batch = await runner.batches.create(file.id, CHAT, "1h", None)
    await asyncio.to_thread(runner.queue.enqueue_validate, batch.id)
    return batch


async def run_until_final(runner: BatchRunner, reaper: Reaper, batch_id: str, rounds: int) -> list[str]:
    """Run the queued jobs, then let the reaper find a lost validation (a lease TTL later) and queue
    it again, ``rounds`` times or until the batch is final; the validation job ids that ran."""
    ran: list[str] = []
    for _ in range(rounds):
        job_id = (await runner.batches.chunk_jobs(batch_id)).get(-1, f"{batch_id}-validate")
        if job_id not in ran and await asyncio.to_thread(runner.queue.waiting, job_id):
            ran.append(job_id)
        await work_queue(runner)
        if (await runner.batches.get(batch_id)).final:
            break
        for _ in range(3):  # a job is suspected lost first, and taken for lost a lease TTL later
            await reaper.one_pass()
            await asyncio.sleep(LEASE_TTL_MS / 1000 * 1.5)
    return ran


def test_a_line_that_raises_outside_pdserves_errors_is_that_lines_error(redis_url: str) -> None:
    """A ``logit_bias`` key of 5000 digits made ``int()`` raise ValueError in the line check: the
    job crashed, and the reaper ran it again every lease TTL (up to 7 days, on up to 100 MB)."""
    long_key = orjson.dumps({**GOOD, "logit_bias": {"7" * 5000: 1}})

    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[BatchObject, list[str]]:
        batch = await queued_batch(runner, [orjson.dumps(GOOD), long_key, orjson.dumps(GOOD)])
        ran = await run_until_final(runner, reaper, batch.id, rounds=4)
        return await runner.batches.get(batch.id), ran

    batch, ran = with_runner(redis_url, main, timeout_s=60, lease_ttl_ms=LEASE_TTL_MS)
    assert batch.status == "failed", (batch.status, ran)
    assert len(ran) == 1, ran  # validated once: never run again
    assert batch.errors is not None
    [error] = batch.errors.data
    assert (error.line, error.param) == (2, "body.logit_bias"), error


def test_a_validation_that_keeps_failing_fails_its_batch_with_the_reason(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault in the check itself (not in one line): each job raises; the third fails the batch."""
    calls: list[int] = []

    def broken_check(*args: Any) -> Any:
        calls.append(1)
        raise RuntimeError("the checker is broken")

    monkeypatch.setattr(runner_module, "check_lines", broken_check)

    async def main(runner: BatchRunner, reaper: Reaper) -> tuple[BatchObject, list[str], list[str]]:
        batch = await queued_batch(runner, [orjson.dumps(GOOD)])
        ran = await run_until_final(runner, reaper, batch.id, rounds=MAX_VALIDATION_FAILURES + 3)
        for _ in range(3):  # a failed batch is left alone
            await reaper.one_pass()
            await asyncio.sleep(LEASE_TTL_MS / 1000)
        waiting = await asyncio.to_thread(runner.queue.waiting_ids)
        return await runner.batches.get(batch.id), ran, sorted(waiting)

    batch, ran, waiting = with_runner(redis_url, main, timeout_s=60, lease_ttl_ms=LEASE_TTL_MS)
    assert batch.status == "failed" and batch.failed_at is not None, (batch.status, ran)
    assert len(calls) == len(ran) == MAX_VALIDATION_FAILURES and waiting == [], (calls, ran, waiting)
    assert batch.errors is not None
    [error] = batch.errors.data
    assert error.code == "validation_failed", error
    assert f"{MAX_VALIDATION_FAILURES} times" in error.message
    assert "RuntimeError: the checker is broken" in error.message


def test_any_exception_a_line_meets_is_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever raises while one line is checked (a bug that line's content meets), the other lines
    are checked and the batch's errors name that line, with the exception's type."""
    from pdserve.batch import validation
    from pdserve.router.api.input_limits import InputLimits

    parse_chat = validation.parse_chat

    def parse(body: bytes, limits: InputLimits) -> Any:
        if b"boom" in body:
            raise KeyError("boom")
        return parse_chat(body, limits)

    monkeypatch.setattr(validation, "parse_chat", parse)
    bodies = [GOOD, {**GOOD, "user": "boom"}, GOOD]
    content = b"\n".join(
        orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": b})
        for i, b in enumerate(bodies)
    )
    limits = InputLimits(16, 16, 16, 16, 16)
    lines, model, errors = validation.check_lines(content, [instance("m1")], limits, 100)
    assert [line.custom_id for line in lines] == ["r0", "r2"] and model == "tiny"
    [error] = errors
    assert (error.line, error.code) == (2, "internal_error") and "KeyError" in error.message, error
