"""A Redis at its ``maxmemory`` under ``noeviction`` (what docker-compose.yml and the Kubernetes
manifests run) refuses writes: the Files and Batches endpoints answer that in OpenAI's shape, 507
``control_plane_full`` saying Redis is full, not as an outage to retry in a second; and an upload
that would take the part of it kept for serving is refused before that."""

from __future__ import annotations

import httpx
import redis
from router_support import router, run

from pdserve.localredis.embedded import EmbeddedRedis
from pdserve.scheduler.redis_server import SERVING_RESERVE_MIN_BYTES

SECRET = b"line-that-must-not-be-echoed"
LINE = (
    b'{"custom_id": "%s", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny"}}\n' % SECRET
)


async def upload(client: httpx.AsyncClient, content: bytes) -> httpx.Response:
    files = {"file": ("in.jsonl", content, "application/jsonl")}
    return await client.post("/v1/files", files=files, data={"purpose": "batch"})


def assert_full(resp: httpx.Response) -> None:
    assert resp.status_code == 507, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("insufficient_storage", "control_plane_full"), error
    assert "Redis is full" in error["message"], error
    assert SECRET.decode() not in error["message"], error  # a pipeline's error quotes its command
    assert "retry-after" not in resp.headers


def test_a_full_redis_answers_uploads_and_new_batches_with_507(private_redis: EmbeddedRedis) -> None:
    """With room, an upload is stored; once Redis is at its maxmemory (set below what it holds), an
    upload and a batch create get 507, reads still answer, and with room again uploads work."""
    admin = redis.Redis.from_url(private_redis.url)

    async def main() -> None:
        async with router(private_redis.url) as client:
            stored = await upload(client, LINE)
            assert stored.status_code == 200, stored.text
            file_id = stored.json()["id"]

            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", 1)  # below what it holds: every write that adds is refused
            assert_full(await upload(client, LINE * 1000))
            body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "1h"}
            assert_full(await client.post("/v1/batches", json=body))
            assert (await client.get(f"/v1/files/{file_id}")).status_code == 200  # reads still work
            assert (await client.get("/v1/batches")).json()["data"] == []  # no batch half made

            admin.config_set("maxmemory", 0)
            again = await upload(client, LINE * 1000)
            assert again.status_code == 200, again.text

    try:
        run(main())
    finally:
        admin.close()


def test_an_upload_that_would_go_into_the_serving_reserve_gets_507(private_redis: EmbeddedRedis) -> None:
    """Redis keeps the last part of its maxmemory for serving (heartbeats, request streams): an
    upload that would go into it is refused with 507 before Redis is full, leaves no partial file,
    and the control plane's own writes still succeed; a small upload that fits is stored."""
    admin = redis.Redis.from_url(private_redis.url)

    async def main() -> None:
        async with router(private_redis.url, quota_bytes="0") as client:  # the reserve alone refuses
            used = int(admin.info("memory")["used_memory"])
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", used + SERVING_RESERVE_MIN_BYTES + (3 << 20))  # 3 MiB of room
            stored = await upload(client, LINE)
            assert stored.status_code == 200, stored.text
            resp = await upload(client, LINE * ((6 << 20) // len(LINE)))  # 6 MiB
            assert resp.status_code == 507, resp.text
            error = resp.json()["error"]
            assert error["code"] == "control_plane_full" and "kept for serving" in error["message"], error
            assert SECRET.decode() not in error["message"]
            assert admin.keys("*partial*") == []  # the pieces stored before the refusal are gone
            assert admin.set("a-heartbeat-sized-write", b"x" * 4096)  # serving still writes
            listed = (await client.get("/v1/files")).json()["data"]
            assert [f["id"] for f in listed] == [stored.json()["id"]]

    try:
        run(main())
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
