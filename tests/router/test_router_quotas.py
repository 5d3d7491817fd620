"""Quotas per API key (``--quota-files``, ``--quota-bytes``, ``--quota-batches``), on a real Redis
through the router's endpoints: a key over one gets a 429 ``quota_exceeded`` in OpenAI's shape that
says which quota and how to free it, while another key's uploads and batches keep working; deleting
a file or a batch ending frees the room; a batch's output files are counted, never refused; and
``pdserve status`` shows what each key digest holds."""

from __future__ import annotations

import httpx
import redis
from router_support import CLUSTER, router, run

from pdserve.router.http.state import RouterState
from pdserve.router.http.tenants import key_digest
from pdserve.status_read import read
from pdserve.status_table import render

A_KEY, B_KEY = "key-a-quota", "key-b-quota"
A, B = {"Authorization": f"Bearer {A_KEY}"}, {"Authorization": f"Bearer {B_KEY}"}
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny"}}\n'


async def upload(client: httpx.AsyncClient, headers: dict, size: int = 1000) -> httpx.Response:
    content = LINE * (size // len(LINE)) + b"\n" * (size % len(LINE))
    files = {"file": ("in.jsonl", content, "application/jsonl")}
    return await client.post("/v1/files", files=files, data={"purpose": "batch"}, headers=headers)


def assert_quota(resp: httpx.Response, flag: str) -> str:
    assert resp.status_code == 429, resp.text
    assert "retry-after" not in resp.headers
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("insufficient_quota", "quota_exceeded"), error
    assert flag in error["message"] and "API key" in error["message"], error
    return error["message"]


def test_a_key_over_its_quotas_gets_429_while_another_key_works(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def main() -> None:
        settings = {
            "api_key": f"{A_KEY},{B_KEY}",
            "quota_files": 2,
            "quota_bytes": "2500",
            "quota_batches": 1,
        }
        async with router(redis_url, **settings) as client:
            state: RouterState = client.app.state.router  # type: ignore[attr-defined]
            first = (await upload(client, A)).json()["id"]
            second = (await upload(client, A)).json()["id"]
            assert_quota(await upload(client, A), "--quota-files 2")
            b_files = [(await upload(client, B)).json()["id"]]  # B has quotas of its own
            assert all(b_files)

            assert (await client.delete(f"/v1/files/{second}", headers=A)).status_code == 200
            message = assert_quota(await upload(client, A, 2000), "--quota-bytes")  # 1000 + 2000 > 2500
            assert "2500 bytes" in message, message
            assert (await upload(client, A, 1000)).status_code == 200  # 2000 of 2500

            body = {"input_file_id": first, "endpoint": "/v1/completions", "completion_window": "24h"}
            made = await client.post("/v1/batches", json=body, headers=A)
            assert made.status_code == 200, made.text
            assert_quota(await client.post("/v1/batches", json=body, headers=A), "--quota-batches 1")
            b_body = {**body, "input_file_id": b_files[0]}
            assert (await client.post("/v1/batches", json=b_body, headers=B)).status_code == 200
            listed = (await client.get("/v1/batches", headers=A)).json()["data"]
            assert [b["id"] for b in listed] == [made.json()["id"]]  # the refused one was never made

            batches, files = state.batches, state.files
            assert batches is not None and files is not None
            ended = await batches.update(made.json()["id"], ("validating",), status="failed", failed_at=1)
            assert ended is not None  # a batch that ends is no longer in flight
            again = await client.post("/v1/batches", json=body, headers=A)
            assert again.status_code == 200, again.text

            # a batch's output is written whatever A holds, and counted: 3 files, 7000 bytes now
            output = await files.create("out.jsonl", "batch_output", b"x" * 5000, key_digest(A_KEY.encode()))
            assert output.bytes == 5000
            assert_quota(await upload(client, A, 10), "--quota-files 2")
            assert (await client.delete(f"/v1/files/{first}", headers=A)).status_code == 409  # its batch
            assert_quota(await upload(client, A, 10), "--quota-files 2")
            assert (await upload(client, B, 10)).status_code == 200

            status = await read(state.redis, CLUSTER)
            usage = {u["owner"]: u for u in status["batches"]["usage"]}
            (row,) = [
                line for line in render(status).splitlines() if line.startswith(key_digest(A_KEY.encode()))
            ]
            assert row.split()[1:] == ["3", "0.0", "MiB", "1"], row
            a, b = usage[key_digest(A_KEY.encode())], usage[key_digest(B_KEY.encode())]
            assert (a["files"], a["bytes"], a["batches"]) == (3, 1000 + 1000 + 5000, 1), a
            assert (b["files"], b["bytes"], b["batches"]) == (2, 1010, 1), b

    run(main(), timeout_s=60)
