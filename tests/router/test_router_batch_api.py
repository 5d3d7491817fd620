"""The Files and Batches endpoints in OpenAI's shapes, on a real Redis. No batch worker runs here, so
a created batch stays ``validating`` with its validation job waiting in the rq queue."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import redis
import rq
from router_support import KEYS, redis_conn, router, run, served_router
from rq.job import Job, JobStatus

from pdserve.batchstore.batch_queue import VALIDATE_JOB, BatchQueue
from pdserve.localredis.embedded import free_port
from pdserve.router.http.state import RouterState

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny"}}\n'
FILE_FIELDS = {"id", "object", "bytes", "created_at", "expires_at", "filename", "purpose", "status"}


def state_of(client: httpx.AsyncClient) -> RouterState:
    return client.app.state.router  # type: ignore[attr-defined]


async def upload(
    client: httpx.AsyncClient, content: bytes = LINE, purpose: str = "batch", name: str = "in.jsonl"
) -> httpx.Response:
    files = {"file": (name, content, "application/jsonl")}
    return await client.post("/v1/files", files=files, data={"purpose": purpose})


async def uploaded(client: httpx.AsyncClient, content: bytes = LINE) -> str:
    resp = await upload(client, content)
    assert resp.status_code == 200, resp.text
    await asyncio.sleep(0.003)  # the listings order by creation time in ms
    return resp.json()["id"]


async def output_file(client: httpx.AsyncClient) -> str:
    """A file as batch workers write them (``batch_output``, which no client may upload)."""
    files = state_of(client).files
    assert files is not None
    return (await files.create("out.jsonl", "batch_output", b"{}\n")).id


def assert_error(resp: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def redis_value(client: redis.Redis, key: bytes) -> bytes:
    """Everything a key holds, as bytes (a string's value; a hash's, set's, zset's, list's members)."""
    kind = client.type(key)
    parts: list = {
        b"string": lambda: [client.get(key)],
        b"hash": lambda: [x for kv in client.hgetall(key).items() for x in kv],
        b"set": lambda: list(client.smembers(key)),
        b"zset": lambda: client.zrange(key, 0, -1),
        b"list": lambda: client.lrange(key, 0, -1),
    }.get(kind, lambda: [repr(client.dump(key)).encode()])()
    return b"\n".join(p for p in parts if p is not None)


def rq_queue(redis_url: str) -> rq.Queue:
    return rq.Queue(KEYS.batch_queue, connection=redis.Redis.from_url(redis_url))


def test_files_upload_get_list_content_delete(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client:
            resp = await upload(client, LINE * 2, name="mine.jsonl")
            assert resp.status_code == 200, resp.text
            info = resp.json()
            assert set(info) == FILE_FIELDS
            assert info["object"] == "file" and info["purpose"] == "batch" and info["status"] == "processed"
            assert info["bytes"] == 2 * len(LINE) and info["filename"] == "mine.jsonl"
            assert info["id"].startswith("file-") and info["expires_at"] > info["created_at"]
            first = info["id"]
            await asyncio.sleep(0.003)
            second, third = await uploaded(client, b"2\n"), await uploaded(client, b"3\n")
            out = await output_file(client)

            assert (await client.get(f"/v1/files/{first}")).json() == info
            content = await client.get(f"/v1/files/{first}/content")
            assert content.status_code == 200 and content.content == LINE * 2
            assert content.headers["content-type"] == "application/jsonl"

            page = (await client.get("/v1/files", params={"limit": 2})).json()
            assert [f["id"] for f in page["data"]] == [out, third]
            assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == (
                "list",
                out,
                third,
                True,
            )
            rest = (await client.get("/v1/files", params={"limit": 2, "after": third})).json()
            assert [f["id"] for f in rest["data"]] == [second, first] and rest["has_more"] is False
            page = (await client.get("/v1/files", params={"purpose": "batch", "order": "asc"})).json()
            assert [f["id"] for f in page["data"]] == [first, second, third]
            page = (await client.get("/v1/files", params={"purpose": "batch_output"})).json()
            assert [f["id"] for f in page["data"]] == [out]
            for param, value in (("limit", "0"), ("limit", "10001"), ("limit", "x"), ("order", "up")):
                assert_error(await client.get("/v1/files", params={param: value}), 400, param)
            assert_error(await client.get("/v1/files", params={"purpose": "fine-tune"}), 400, "purpose")

            deleted = await client.delete(f"/v1/files/{second}")
            assert deleted.status_code == 200
            assert deleted.json() == {"id": second, "object": "file", "deleted": True}
            for resp in (
                await client.get(f"/v1/files/{second}"),
                await client.get(f"/v1/files/{second}/content"),
                await client.delete(f"/v1/files/{second}"),
                await client.get("/v1/files/no:such"),
            ):
                assert_error(resp, 404, "file_id", "not_found")
            page = (await client.get("/v1/files", params={"purpose": "batch"})).json()
            assert [f["id"] for f in page["data"]] == [third, first]

    run(main())


def test_uploads_without_a_file_or_with_another_purpose_are_refused(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main() -> None:
        async with router(redis_url) as client:
            assert_error(await upload(client, purpose="fine-tune"), 400, "purpose")
            assert_error(await upload(client, purpose="batch_output"), 400, "purpose")
            assert_error(await client.post("/v1/files", data={"purpose": "batch"}), 400, "file")
            as_text = {"file": (None, "not a file part"), "purpose": (None, "batch")}
            assert_error(await client.post("/v1/files", files=as_text), 400, "file")
            assert (await client.get("/v1/files")).json()["data"] == []

    run(main())


def test_oversized_uploads_are_cut_at_the_limit(redis_url: str, redis_client: redis.Redis) -> None:
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n'
        while True:
            sent += 1
            yield b"x" * 16384

    async def main() -> None:
        async with router(redis_url, max_file_bytes=1000) as client:
            error = assert_error(await upload(client, b"x" * 1001), 413, "file", "request_too_large")
            assert "1000 bytes" in error["message"]
            assert (await upload(client, b"x" * 1000)).status_code == 200  # the limit itself is fine

            # refused by its Content-Length alone: parsing this tiny body would answer 400
            headers = {"content-type": "multipart/form-data; boundary=b", "content-length": str(10**9)}
            resp = await client.post("/v1/files", content=b"--b--\r\n", headers=headers)
            assert "1000 bytes" in assert_error(resp, 413, "file", "request_too_large")["message"]

            chunked = {"content-type": "multipart/form-data; boundary=b"}
            resp = await client.post("/v1/files", content=endless(), headers=chunked)
            assert_error(resp, 413, "file", "request_too_large")
            assert sent <= (1000 + 64 * 1024) // 16384 + 1  # read no further than the limit
            assert (await upload(client)).status_code == 200  # and serves on
            assert len((await client.get("/v1/files")).json()["data"]) == 2

    run(main())


def test_files_dir_keeps_the_bytes_in_the_folder(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    async def main() -> None:
        async with router(redis_url, files_dir=str(tmp_path)) as client:
            file_id = await uploaded(client, LINE * 3)
            assert (tmp_path / f"{file_id}.jsonl").read_bytes() == LINE * 3
            assert redis_client.exists(KEYS.file(file_id)) == 1
            assert redis_client.exists(KEYS.file_content(file_id)) == 0
            assert (await client.get(f"/v1/files/{file_id}/content")).content == LINE * 3
            assert (await client.delete(f"/v1/files/{file_id}")).status_code == 200
            assert not (tmp_path / f"{file_id}.jsonl").exists()

    run(main())


def test_batch_create_refuses_each_bad_field(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url, max_body_bytes=1024) as client:
            file_id = await uploaded(client)
            out = await output_file(client)
            ok = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            cases: list[tuple[dict[str, Any], int, str]] = [
                ({"endpoint": "/v1/embeddings"}, 400, "endpoint"),
                ({"completion_window": "24x"}, 400, "completion_window"),
                ({"completion_window": "8d"}, 400, "completion_window"),
                ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
                ({"metadata": {"k" * 65: "v"}}, 400, "metadata"),
                ({"metadata": {"k": "v" * 513}}, 400, "metadata"),
                ({"input_file_id": "file-nope"}, 404, "input_file_id"),
                ({"input_file_id": "no:such"}, 404, "input_file_id"),
                ({"input_file_id": out}, 400, "input_file_id"),
                ({"input_file_id": 5}, 400, "input_file_id"),
                ({"model": "tiny"}, 400, "model"),  # unknown fields are refused, not ignored
            ]
            for change, status, param in cases:
                resp = await client.post("/v1/batches", json={**ok, **change})
                error = assert_error(resp, status, param)
                if param == "endpoint":
                    assert "/v1/chat/completions, /v1/completions" in error["message"]
                if status == 404:
                    assert error["code"] == "not_found"
            without = {k: v for k, v in ok.items() if k != "endpoint"}
            assert_error(await client.post("/v1/batches", json=without), 400, "endpoint")
            big = {**ok, "metadata": {"k": "v" * 2000}}
            assert_error(await client.post("/v1/batches", json=big), 413, None, "request_too_large")
            assert (await client.get("/v1/batches")).json()["data"] == []
            assert rq_queue(redis_url).count == 0

    run(main())


def test_batch_create_queues_validation_and_lists(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client:
            file_id = await uploaded(client)
            body = {
                "input_file_id": file_id,
                "endpoint": "/v1/completions",
                "completion_window": "24h",
                "metadata": {"team": "a"},
            }
            resp = await client.post("/v1/batches", json=body)
            assert resp.status_code == 200, resp.text
            batch = resp.json()
            assert batch["object"] == "batch" and batch["status"] == "validating"
            assert batch["id"].startswith("batch_") and batch["input_file_id"] == file_id
            assert batch["expires_at"] == batch["created_at"] + 24 * 3600
            assert batch["metadata"] == {"team": "a"} and batch["request_counts"]["total"] == 0
            assert "chunks" not in batch and "chunk_lines" not in batch
            queue = rq_queue(redis_url)
            assert queue.job_ids == [f"{batch['id']}-validate"]
            job = queue.fetch_job(f"{batch['id']}-validate")
            assert job is not None and job.func_name == VALIDATE_JOB and job.args == (batch["id"],)
            assert (await client.get(f"/v1/batches/{batch['id']}")).json() == batch

            ids = [batch["id"]]
            for _ in range(2):
                await asyncio.sleep(0.003)
                created = await client.post("/v1/batches", json={**body, "metadata": None})
                ids.insert(0, created.json()["id"])
            page = (await client.get("/v1/batches", params={"limit": 2})).json()
            assert [b["id"] for b in page["data"]] == ids[:2]
            assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == (
                "list",
                ids[0],
                ids[1],
                True,
            )
            rest = (await client.get("/v1/batches", params={"after": ids[1]})).json()
            assert [b["id"] for b in rest["data"]] == ids[2:] and rest["has_more"] is False
            assert len((await client.get("/v1/batches")).json()["data"]) == 3
            for limit in ("0", "101", "-1"):
                assert_error(await client.get("/v1/batches", params={"limit": limit}), 400, "limit")
            assert_error(await client.get("/v1/batches/batch_nope"), 404, "batch_id", "not_found")

    run(main())


def test_a_file_an_active_batch_reads_cannot_be_deleted_and_outlives_its_window(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """409 in OpenAI's shape naming the batch while it is not final; a file TTL (here 60 s) shorter
    than the window is extended past the batch's expiry; once the batch is final the file goes."""

    async def main() -> None:
        async with router(redis_url, file_ttl_s=60) as client:
            file_id = await uploaded(client)
            body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "2h"}
            resp = await client.post("/v1/batches", json=body)
            assert resp.status_code == 200, resp.text
            batch = resp.json()
            error = assert_error(await client.delete(f"/v1/files/{file_id}"), 409, "file_id", "conflict")
            assert batch["id"] in error["message"] and error["type"] == "invalid_request_error"
            assert (await client.get(f"/v1/files/{file_id}")).status_code == 200
            info = (await client.get(f"/v1/files/{file_id}")).json()
            assert info["expires_at"] >= batch["expires_at"]
            for key in (KEYS.file(file_id), KEYS.file_content(file_id)):
                assert redis_client.pttl(key) > 2 * 3600 * 1000, key

            batches = state_of(client).batches
            assert batches is not None
            assert await batches.update(batch["id"], ("validating",), status="cancelled", cancelled_at=1)
            resp = await client.delete(f"/v1/files/{file_id}")
            assert resp.status_code == 200 and resp.json()["deleted"] is True, resp.text

            # a batch recorded as reading a file but never made (its router crashed) blocks nothing
            other = await uploaded(client)
            files = state_of(client).files
            assert files is not None
            await files.hold(other, "batch_never_made", time.time() + 3600)
            assert (await client.delete(f"/v1/files/{other}")).status_code == 200

    run(main())


def test_a_batch_whose_validation_cannot_be_queued_fails(redis_url: str, redis_client: redis.Redis) -> None:
    """rq's Redis refusing: 503, and the batch is failed at once instead of waiting for nothing."""

    async def main() -> None:
        async with router(redis_url) as client:
            file_id = await uploaded(client)
            state = state_of(client)
            state._batch_queue = BatchQueue(redis.Redis(port=free_port()), KEYS)
            body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "1h"}
            assert_error(await client.post("/v1/batches", json=body), 503, None, "control_plane_unavailable")
            [batch] = (await client.get("/v1/batches")).json()["data"]
            assert batch["status"] == "failed" and batch["failed_at"] is not None
            assert batch["errors"]["data"][0]["code"] == "enqueue_failed"

    run(main())


def test_batches_on_a_redis_cluster_are_a_configuration_error(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """rq cannot use a Redis Cluster: a clear 500 before any batch is recorded."""

    async def main() -> None:
        async with router(redis_url) as client:
            file_id = await uploaded(client)
            state = state_of(client)
            state.settings = dataclasses.replace(state.settings, redis_url="redis+cluster://127.0.0.1:1")
            body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "1h"}
            error = assert_error(
                await client.post("/v1/batches", json=body), 500, None, "configuration_error"
            )
            assert "Cluster" in error["message"]
            assert (await client.get("/v1/batches")).json()["data"] == []

    run(main())


def test_cancel_marks_cancelling_takes_queued_chunks_out_and_refuses_finished_batches(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main() -> None:
        async with router(redis_url) as client, redis_conn(redis_url) as r:
            state = state_of(client)
            batches = state.batches
            assert batches is not None
            file_id = await uploaded(client)
            body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            ids = [(await client.post("/v1/batches", json=body)).json()["id"] for _ in range(3)]

            # a batch running two chunks: one still queued, one a worker took
            running = ids[0]
            assert await batches.update(running, ("validating",), status="in_progress") is not None
            queue = state.batch_queue()
            queued, started = queue.enqueue_chunk(running, 0), queue.enqueue_chunk(running, 1)
            Job.fetch(started, connection=queue.connection).set_status(JobStatus.STARTED)
            await batches.set_chunk_jobs(running, {0: queued, 1: started})
            await batches.record(running, 0, {"ok": 1}, error=False)
            resp = await client.post(f"/v1/batches/{running}/cancel")
            assert resp.status_code == 200, resp.text
            batch = resp.json()
            assert batch["status"] == "cancelling" and batch["cancelling_at"] is not None
            assert batch["request_counts"]["completed"] == 1
            assert queue.status(queued) == JobStatus.CANCELED and not queue.waiting(queued)
            assert queue.status(started) == JobStatus.STARTED
            again = await client.post(f"/v1/batches/{running}/cancel")
            assert again.status_code == 200 and again.json() == batch

            validating = (await client.post(f"/v1/batches/{ids[1]}/cancel")).json()
            assert validating["status"] == "cancelling"

            finished = ids[2]
            assert await batches.update(finished, ("validating",), status="completed") is not None
            error = assert_error(await client.post(f"/v1/batches/{finished}/cancel"), 400, "batch_id")
            assert error["message"] == "cannot cancel a batch that is completed"
            assert (await client.get(f"/v1/batches/{finished}")).json()["status"] == "completed"
            for unknown in ("batch_nope", "no:such"):
                assert_error(await client.post(f"/v1/batches/{unknown}/cancel"), 404, "batch_id", "not_found")
            assert await r.exists(KEYS.batch("batch_nope")) == 0

    run(main())


def test_the_openai_client_reads_every_answer(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The official SDK against uvicorn: each response parses into (and validates as) its type."""
    path = tmp_path / "requests.jsonl"
    path.write_bytes(LINE * 2)

    def use(base_url: str) -> None:
        sdk = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        with path.open("rb") as f:
            created = sdk.files.create(file=f, purpose="batch")
        assert isinstance(created, openai.types.FileObject) and created.bytes == 2 * len(LINE)
        assert sdk.files.retrieve(created.id) == created
        assert sdk.files.content(created.id).content == LINE * 2
        assert [f.id for f in sdk.files.list(purpose="batch")] == [created.id]
        batch = sdk.batches.create(
            input_file_id=created.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"run": "1"},
        )
        assert isinstance(batch, openai.types.Batch) and batch.status == "validating"
        assert batch.request_counts is not None and batch.request_counts.total == 0
        assert sdk.batches.retrieve(batch.id) == batch
        assert [b.id for b in sdk.batches.list(limit=5)] == [batch.id]
        cancelled = sdk.batches.cancel(batch.id)
        assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
        for obj in (created, batch, cancelled):
            type(obj).model_validate(obj.to_dict())  # the shape, not only what the SDK tolerates
        try:  # cancelling is not final yet: the batch still reads its input file
            sdk.files.delete(created.id)
        except openai.ConflictError as e:
            assert e.status_code == 409 and e.code == "conflict" and batch.id in e.message
        else:
            raise AssertionError("an active batch's input file was deleted")
        with path.open("rb") as f:
            unused = sdk.files.create(file=f, purpose="batch")
        deleted = sdk.files.delete(unused.id)
        assert deleted.deleted and deleted.id == unused.id
        try:
            sdk.batches.retrieve("batch_nope")
        except openai.NotFoundError as e:
            assert e.status_code == 404 and e.code == "not_found" and e.param == "batch_id"
        else:
            raise AssertionError("a missing batch was found")

    async def main() -> None:
        async with served_router(redis_url) as client:
            await asyncio.to_thread(use, str(client.base_url.join("/v1")))

    run(main(), timeout_s=60)


def test_the_bodies_read_by_hand_are_in_the_openapi_schema(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        async with router(redis_url) as client:
            paths = (await client.get("/openapi.json")).json()["paths"]
            upload = paths["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
            assert set(upload["properties"]) == {"file", "purpose"}
            body = paths["/v1/batches"]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert set(body["properties"]) == {"input_file_id", "endpoint", "completion_window", "metadata"}
            assert {"get", "delete"} <= set(paths["/v1/files/{file_id}"])
            assert "post" in paths["/v1/batches/{batch_id}/cancel"]

    run(main())


def test_files_and_batches_belong_to_the_key_that_made_them(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """With API keys, a file and a batch are their creator's: another key gets 404 for them (the
    same answer as for no such id), lists none of them, cannot cancel or delete them, nor build a
    batch on the file; a batch's output file is its owner's. Redis holds a digest, never the key."""
    a_key, b_key = "key-a-" + "s3cret" * 4, "key-b-" + "s3cret" * 4
    a, b = {"Authorization": f"Bearer {a_key}"}, {"Authorization": f"Bearer {b_key}"}

    async def main() -> None:
        async with router(redis_url, api_key=f"{a_key},{b_key}") as client:
            resp = await client.post(
                "/v1/files",
                files={"file": ("in.jsonl", LINE, "application/jsonl")},
                data={"purpose": "batch"},
            )
            assert_error(resp, 401, None, "invalid_api_key")
            files = {"file": ("in.jsonl", LINE, "application/jsonl")}
            resp = await client.post("/v1/files", files=files, data={"purpose": "batch"}, headers=a)
            assert resp.status_code == 200, resp.text
            info = resp.json()
            assert set(info) == FILE_FIELDS  # the owner is not shown
            file_id = info["id"]
            resp = await client.post("/v1/files", files=files, data={"purpose": "batch"}, headers=b)
            b_file = resp.json()["id"]

            assert (await client.get(f"/v1/files/{file_id}", headers=a)).json() == info
            assert (await client.get(f"/v1/files/{file_id}/content", headers=a)).content == LINE
            for resp in (
                await client.get(f"/v1/files/{file_id}", headers=b),
                await client.get(f"/v1/files/{file_id}/content", headers=b),
                await client.delete(f"/v1/files/{file_id}", headers=b),
            ):
                error = assert_error(resp, 404, "file_id", "not_found")
                assert error["message"] == f"No such file: {file_id}"
            assert [f["id"] for f in (await client.get("/v1/files", headers=a)).json()["data"]] == [file_id]
            assert [f["id"] for f in (await client.get("/v1/files", headers=b)).json()["data"]] == [b_file]

            body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            error = assert_error(await client.post("/v1/batches", json=body, headers=b), 404, "input_file_id")
            assert error["code"] == "not_found"
            assert rq_queue(redis_url).job_ids == []  # nothing was made
            resp = await client.post("/v1/batches", json=body, headers=a)
            assert resp.status_code == 200, resp.text
            batch = resp.json()
            assert "owner" not in batch
            for resp in (
                await client.get(f"/v1/batches/{batch['id']}", headers=b),
                await client.post(f"/v1/batches/{batch['id']}/cancel", headers=b),
            ):
                assert_error(resp, 404, "batch_id", "not_found")
            assert (await client.get("/v1/batches", headers=b)).json()["data"] == []
            assert [x["id"] for x in (await client.get("/v1/batches", headers=a)).json()["data"]] == [
                batch["id"]
            ]
            assert (await client.get(f"/v1/batches/{batch['id']}", headers=a)).json()[
                "status"
            ] == "validating"

            # what a batch worker writes for the batch is its owner's
            store, file_store = state_of(client).batches, state_of(client).files
            assert store is not None and file_store is not None
            owner = (await store.get(batch["id"])).owner
            out = await file_store.create("out.jsonl", "batch_output", b"{}\n", owner)
            assert (await client.get(f"/v1/files/{out.id}/content", headers=a)).content == b"{}\n"
            assert_error(await client.get(f"/v1/files/{out.id}/content", headers=b), 404, "file_id")

            resp = await client.post(f"/v1/batches/{batch['id']}/cancel", headers=a)
            assert resp.status_code == 200 and resp.json()["status"] == "cancelling", resp.text
            assert (await client.delete(f"/v1/files/{b_file}", headers=b)).status_code == 200

        for key in redis_client.scan_iter("*"):  # the keys are secrets: only their digests are stored
            assert b"s3cret" not in redis_value(redis_client, key), key
        assert owner and owner not in (a_key, b_key) and len(owner) == 32

    run(main())


def test_without_api_keys_every_file_and_batch_is_the_anonymous_owners(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main() -> None:
        async with router(redis_url) as client:
            file_id = await uploaded(client)
            body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
            batch = (await client.post("/v1/batches", json=body)).json()
            store = state_of(client).batches
            assert store is not None and (await store.get(batch["id"])).owner == ""
            assert (
                await client.get(f"/v1/files/{file_id}", headers={"Authorization": "Bearer x"})
            ).status_code == 200

    run(main())
