"""The Batch API end to end: the official ``openai`` client against a splitwise stack of the tiny
model with a batch worker; batch answers equal online answers; a batch worker SIGKILLed mid-batch
(and a job lost between rq popping it and starting it) loses and doubles no line; cancel and expiry
leave partial output; malformed input fails clearly and disturbs nothing else."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis

from pdserve.batchstore.batch_queue import BatchQueue
from pdserve.localredis.embedded import free_port
from pdserve.scheduler.keys import Keys
from pdserve.stack import Stack
from tests.e2e.test_serving import client, model_name, start_stack

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "adult": {"type": "boolean"}},
    "required": ["name", "adult"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def batch_stack(tiny_model_dir, redis_url) -> Iterator[Stack]:
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=1, batch_workers=1)
    yield stack
    assert stack.stop(grace_s=15) == []


def jsonl(lines: list[dict]) -> bytes:
    return b"\n".join(orjson.dumps(line) for line in lines) + b"\n"


def batch_lines(model: str, n: int, max_tokens: int = 8) -> list[dict]:
    """Chat and completions lines alternating; every tenth chat line asks for JSON output."""
    lines = []
    for i in range(n):
        if i % 2:
            body: dict = {"model": model, "prompt": f"Line {i} of the batch:", "max_tokens": max_tokens}
            url = "/v1/completions"
        else:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Say {i}"}],
                "max_tokens": max_tokens,
            }
            url = "/v1/chat/completions"
            if i % 20 == 0:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA},
                }
                body["max_tokens"] = 64
        body["temperature"] = 0
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return lines


def wait_final(oc: openai.OpenAI, batch_id: str, timeout_s: float = 300) -> openai.types.Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = oc.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout_s} s: {batch}"
        time.sleep(0.5)


def wait_for(oc: openai.OpenAI, batch_id: str, done: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while oc.batches.retrieve(batch_id).request_counts.completed < done:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, f"fewer than {done} lines done after {timeout_s} s"
        time.sleep(0.1)


def download(oc: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [orjson.loads(line) for line in oc.files.content(file_id).content.splitlines()]


def answer(body: dict) -> object:
    """What must match between a batch line and the same request sent online."""
    return [(c.get("message") or {}).get("content", c.get("text")) for c in body["choices"]], body["usage"]


def create(oc: openai.OpenAI, lines: list[dict], window: str = "24h") -> str:
    file = oc.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return oc.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window=window
    ).id  # type: ignore[arg-type]


def test_a_200_line_batch_answers_as_online_requests(batch_stack) -> None:
    oc = client(batch_stack)
    lines = batch_lines(model_name(batch_stack), 200)
    batch_id = create(oc, lines)
    batch = wait_final(oc, batch_id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        200,
        200,
        0,
    )
    assert batch.error_file_id is None
    out = download(oc, batch.output_file_id)
    assert len(out) == 200
    by_id = {o["custom_id"]: o for o in out}
    assert sorted(by_id) == sorted(line["custom_id"] for line in lines)
    with httpx.Client(base_url=batch_stack.urls[0], timeout=120) as hc:
        for line in lines:
            got = by_id[line["custom_id"]]
            assert got["response"]["status_code"] == 200 and got["error"] is None
            online = hc.post(line["url"], json=line["body"])
            assert online.status_code == 200, online.text
            assert answer(got["response"]["body"]) == answer(online.json()), line
            if "response_format" in line["body"]:
                choice = got["response"]["body"]["choices"][0]
                assert choice["finish_reason"] == "stop", choice
                assert set(orjson.loads(choice["message"]["content"])) == {"name", "adult"}


def test_cancel_leaves_the_lines_done_downloadable(batch_stack) -> None:
    oc = client(batch_stack)
    lines = batch_lines(model_name(batch_stack), 300, max_tokens=16)
    batch_id = create(oc, lines)
    wait_for(oc, batch_id, 10)
    deadline = time.monotonic() + 10  # the decode instance reports the lines as background work
    while True:
        live = httpx.get(batch_stack.urls[0] + "/v1/instances", timeout=5).json()["instances"]
        (decode,) = [i for i in live if i["role"] == "decode"]
        if decode["load"]["background"] > 0:
            break
        assert time.monotonic() < deadline, decode
        time.sleep(0.2)
    assert decode["load"]["running"] + decode["load"]["waiting"] >= decode["load"]["background"]
    assert oc.batches.cancel(batch_id).status in ("cancelling", "cancelled")
    batch = wait_final(oc, batch_id, 60)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts is not None
    done = batch.request_counts.completed
    assert 10 <= done < 300
    out = download(oc, batch.output_file_id)
    assert len(out) == done == len({o["custom_id"] for o in out})
    assert all(o["response"]["status_code"] == 200 for o in out)
    time.sleep(2)  # nothing runs after the cancel
    assert oc.batches.retrieve(batch_id).request_counts.completed == done  # type: ignore[union-attr]


def test_a_batch_past_its_window_expires_with_partial_output(batch_stack) -> None:
    oc = client(batch_stack)
    lines = batch_lines(model_name(batch_stack), 800, max_tokens=24)
    batch_id = create(oc, lines, window="6s")
    batch = wait_final(oc, batch_id, 90)
    assert batch.status == "expired" and batch.expired_at is not None, batch
    assert batch.request_counts is not None
    done, failed = batch.request_counts.completed, batch.request_counts.failed
    assert 0 < done < 800 and done + failed == 800
    out, errors = download(oc, batch.output_file_id), download(oc, batch.error_file_id)
    assert len(out) == done and len(errors) == failed
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert {o["custom_id"] for o in out}.isdisjoint(e["custom_id"] for e in errors)


def test_malformed_input_fails_clearly_and_nothing_else_is_affected(batch_stack) -> None:
    oc = client(batch_stack)
    model = model_name(batch_stack)
    good_id = create(oc, batch_lines(model, 40))
    good = batch_lines(model, 3)
    bad = [
        good[0],
        b'{"custom_id": "x", "method": "POST", "url": ',  # not JSON
        {**good[1], "custom_id": "y", "url": "/v1/embeddings"},
        {**good[2], "custom_id": "z", "body": {**good[2]["body"], "model": "no-such-model"}},
        {**good[1], "custom_id": "w", "body": {**good[1]["body"], "max_tokens": -1}},
        {**good[1], "custom_id": good[0]["custom_id"]},
    ]
    raw = b"\n".join(line if isinstance(line, bytes) else orjson.dumps(line) for line in bad)
    file = oc.files.create(file=("bad.jsonl", io.BytesIO(raw)), purpose="batch")
    bad_batch = oc.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with httpx.Client(base_url=batch_stack.urls[0], timeout=60) as hc:  # online requests meanwhile
        for i in range(5):
            r = hc.post("/v1/completions", json={"model": model, "prompt": f"online {i}", "max_tokens": 4})
            assert r.status_code == 200, r.text
        unknown = hc.post(
            "/v1/batches",
            json={"input_file_id": file.id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
        )
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "endpoint"
    failed = wait_final(oc, bad_batch.id, 60)
    assert failed.status == "failed" and failed.errors is not None
    found = {(e.line, e.code, e.param) for e in failed.errors.data or []}
    assert found == {
        (2, "invalid_json_line", None),
        (3, "invalid_request", "url"),
        (4, "model_not_found", "body.model"),
        (5, "invalid_request", "body.max_tokens"),
        (6, "invalid_request", "custom_id"),
    }, found
    batch = wait_final(oc, good_id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == 40


# ---- crashes: an echo stack, the batch worker run by the test ---------------------------------


@pytest.fixture(scope="module")
def echo_stack(tiny_model_dir, redis_url) -> Iterator[Stack]:
    stack = start_stack(tiny_model_dir, redis_url, mixed=1, engine_kind="echo")
    yield stack
    assert stack.stop(grace_s=15) == []


def batch_worker(stack: Stack, name: str, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PDSERVE_REDIS_URL": stack.redis_url}
    cmd = [sys.executable, "-P", "-m", "pdserve.cli", "batch-worker", "--cluster", stack.spec.cluster]
    return subprocess.Popen([*cmd, "--name", name, "--ttl", "3", *flags], env=env)


def test_a_batch_worker_killed_mid_batch_loses_and_doubles_no_line(echo_stack, redis_url) -> None:
    oc = client(echo_stack)
    n = 600
    lines = batch_lines(model_name(echo_stack), n, max_tokens=64)
    for line in lines:
        line["body"].pop("response_format", None)
    batch_id = create(oc, lines)
    first = batch_worker(echo_stack, "doomed", "--chunk-lines", "100", "--concurrency", "2")
    try:
        wait_for(oc, batch_id, 30)
        first.send_signal(signal.SIGKILL)  # mid-chunk: its lease and rq job are left behind
        first.wait(10)
        killed_at = oc.batches.retrieve(batch_id).request_counts.completed  # type: ignore[union-attr]
        assert killed_at < n
        second = batch_worker(echo_stack, "heir")
        try:
            batch = wait_final(oc, batch_id, 180)
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
    finally:
        first.kill()
    assert batch.status == "completed", batch
    out = download(oc, batch.output_file_id)
    ids = [o["custom_id"] for o in out]
    assert len(ids) == n and set(ids) == {line["custom_id"] for line in lines}, "a line lost or doubled"
    jobs = redis.Redis.from_url(redis_url).hgetall(Keys(echo_stack.spec.cluster).batch_chunks(batch_id))
    assert not jobs, "a finished batch keeps no chunk jobs"


def test_a_job_lost_between_pop_and_start_is_run_again(echo_stack, redis_url) -> None:
    """rq moves a job from the queue to an intermediate list, then registers it as started: a
    worker that dies in between leaves it in neither. Done here by hand, as that worker would."""
    oc = client(echo_stack)
    batch_id = create(oc, batch_lines(model_name(echo_stack), 20)[1::2])  # completions lines only
    conn = redis.Redis.from_url(redis_url)
    queue = BatchQueue(conn, Keys(echo_stack.spec.cluster))
    validate = f"{batch_id}-validate"
    assert queue.waiting(validate)
    conn.lmove(queue.queue.key, queue.queue.intermediate_queue_key, "LEFT", "RIGHT")  # popped, then died
    assert not queue.waiting(validate)
    metrics_port = free_port()
    worker = batch_worker(echo_stack, "rescuer", "--metrics-port", str(metrics_port))
    try:
        batch = wait_final(oc, batch_id, 60)
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert 'pdserve_batch_lines_total{outcome="completed"} 10.0' in metrics, metrics
        rq_info = subprocess.run(
            [str(Path(sys.executable).parent / "rq"), "info", "--url", redis_url],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert rq_info.returncode == 0, rq_info.stderr
        assert f"pdserve-batch-{echo_stack.spec.cluster}" in rq_info.stdout  # the queue
        assert "rescuer" in rq_info.stdout  # the worker
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == 10


def test_an_output_larger_than_the_upload_limit_completes(echo_stack) -> None:
    """``--max-file-bytes`` bounds uploads: a batch worker whose limit is a third of the batch's
    output still writes it (it raised, and the batch stayed ``finalizing`` forever). A second batch,
    created while the first runs, completes too, within a minute of its creation."""
    oc = client(echo_stack)
    limit = 20_000
    lines = batch_lines(model_name(echo_stack), 200, max_tokens=32)
    for line in lines:
        line["body"].pop("response_format", None)
    batch_id = create(oc, lines)
    worker = batch_worker(echo_stack, "big-output", "--max-file-bytes", str(limit))
    try:
        wait_for(oc, batch_id, 1)
        second_lines = lines[1:40:2]  # completions lines
        second_id = create(oc, second_lines)
        second_created = time.monotonic()
        second = wait_final(oc, second_id, 60)
        second_s = time.monotonic() - second_created
        batch = wait_final(oc, batch_id, 90)
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    assert batch.status == "completed", batch
    content = oc.files.content(batch.output_file_id).content  # type: ignore[arg-type]
    assert len(content) > 3 * limit
    out = [orjson.loads(line) for line in content.splitlines()]
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in lines]
    assert second.status == "completed" and second_s < 60, (second, second_s)
    assert sorted(o["custom_id"] for o in download(oc, second.output_file_id)) == sorted(
        line["custom_id"] for line in second_lines
    )
