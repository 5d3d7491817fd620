"""Uploads and downloads of files go through the router piece by piece (``FileStore.store`` /
``FileStore.open``) and under its admission: a file is never held whole, a failed or refused upload
leaves nothing, and a router whose slots are taken refuses an upload as it refuses a generation.
Real Redis throughout; the memory test serves the router with uvicorn on a real socket."""

from __future__ import annotations

import asyncio
import hashlib
import math
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import redis
from router_support import KEYS, redis_conn, router, run, served_router

from pdserve.batchstore.files import CHUNK_BYTES, FileStore
from pdserve.errors import ControlPlaneError, InvalidRequestError
from pdserve.router.http.state import RouterState

BOUNDARY = "pdserve-test-boundary"


def jsonl(size: int) -> bytes:
    """About ``size`` bytes of distinct JSONL lines (a piece stored twice or out of order shows)."""
    line = b'{"custom_id": "%09d", "method": "POST", "url": "/v1/completions", "pad": "%s"}\n'
    per = len(line % (0, b"x" * 40))
    return b"".join(line % (i, b"x" * 40) for i in range(size // per + 1))


def multipart(content: bytes, piece: int = 64 * 1024) -> tuple[dict[str, str], AsyncIterator[bytes]]:
    """A ``purpose=batch`` upload of ``content`` as a streamed body (slices of ``piece`` bytes, so the
    client holds no copy of the file either) and its headers."""
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    tail = f"\r\n--{BOUNDARY}--\r\n".encode()

    async def body() -> AsyncIterator[bytes]:
        yield head
        for start in range(0, len(content), piece):
            yield content[start : start + piece]
        yield tail

    headers = {
        "content-type": f"multipart/form-data; boundary={BOUNDARY}",
        "content-length": str(len(head) + len(content) + len(tail)),
    }
    return headers, body()


def state_of(client: httpx.AsyncClient) -> RouterState:
    return client.app.state.router  # type: ignore[attr-defined]


def file_keys(client: redis.Redis) -> list[bytes]:
    """Every key of a file (metadata, content, partial) and the files index, if present."""
    return sorted(client.scan_iter(match=f"*:{KEYS.cluster}:file:*")) + (
        [KEYS.files.encode()] if client.exists(KEYS.files) else []
    )


@pytest.mark.parametrize("in_dir", [False, True], ids=["redis", "files-dir"])
def test_a_file_of_several_mib_is_stored_and_read_back_byte_identical(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, in_dir: bool
) -> None:
    content = jsonl(5 * CHUNK_BYTES + 12345)  # several pieces, the last one partial

    async def main() -> None:
        overrides = {"files_dir": str(tmp_path)} if in_dir else {}
        async with router(redis_url, **overrides) as client:
            headers, body = multipart(content)
            resp = await client.post("/v1/files", content=body, headers=headers)
            assert resp.status_code == 200, resp.text
            info = resp.json()
            assert info["bytes"] == len(content) and info["filename"] == "big.jsonl"
            got = await client.get(f"/v1/files/{info['id']}/content")
            assert got.status_code == 200
            assert got.headers["content-length"] == str(len(content))
            assert got.headers["content-type"] == "application/jsonl"
            assert got.content == content
            assert not redis_client.exists(KEYS.file_partial(info["id"]))
            if in_dir:
                assert (tmp_path / f"{info['id']}.jsonl").read_bytes() == content
                assert not list(tmp_path.glob(".*.tmp"))
                assert not redis_client.exists(KEYS.file_content(info["id"]))
            else:
                assert redis_client.get(KEYS.file_content(info["id"])) == content
                assert (
                    0
                    < redis_client.ttl(KEYS.file_content(info["id"]))
                    <= redis_client.ttl(KEYS.file(info["id"]))
                )
            # an empty file is a file too
            headers, body = multipart(b"")
            empty = await client.post("/v1/files", content=body, headers=headers)
            assert empty.status_code == 200 and empty.json()["bytes"] == 0
            got = await client.get(f"/v1/files/{empty.json()['id']}/content")
            assert got.status_code == 200 and got.content == b""

    run(main(), timeout_s=60)


def test_the_router_holds_a_piece_of_a_large_file_never_the_whole(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Peak Python memory (tracemalloc: the router, uvicorn and the client, all in this process) while
    a 32 MiB file is uploaded and downloaded stays far below its size; before, the upload read the
    whole file (``upload.read()``) into one SET and the download sent one GET's value."""
    content = jsonl(32 * CHUNK_BYTES)
    digest = hashlib.sha256(content).hexdigest()

    async def main() -> None:
        async with served_router(redis_url, max_file_bytes=64 * CHUNK_BYTES) as client:
            appends = redis_client.info("commandstats").get("cmdstat_append", {}).get("calls", 0)
            tracemalloc.start()
            try:
                tracemalloc.reset_peak()
                headers, body = multipart(content)
                resp = await client.post("/v1/files", content=body, headers=headers, timeout=60)
                assert resp.status_code == 200, resp.text
                upload_peak = tracemalloc.get_traced_memory()[1]

                tracemalloc.reset_peak()
                sha, size = hashlib.sha256(), 0
                async with client.stream("GET", f"/v1/files/{resp.json()['id']}/content") as got:
                    assert got.status_code == 200
                    async for part in got.aiter_bytes():
                        sha.update(part)
                        size += len(part)
                download_peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert size == len(content) and sha.hexdigest() == digest
            assert upload_peak < len(content) / 4, f"uploading held {upload_peak} bytes at once"
            assert download_peak < len(content) / 4, f"downloading held {download_peak} bytes at once"
            stats = redis_client.info("commandstats")
            assert stats["cmdstat_append"]["calls"] - appends >= math.ceil(len(content) / CHUNK_BYTES)

    run(main(), timeout_s=90)


@pytest.mark.parametrize("in_dir", [False, True], ids=["redis", "files-dir"])
def test_an_upload_over_the_limit_gets_413_and_leaves_nothing(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, in_dir: bool
) -> None:
    limit = 2 * CHUNK_BYTES
    content = jsonl(limit + 1)[: limit + 1]

    async def main() -> None:
        overrides = {"files_dir": str(tmp_path)} if in_dir else {}
        async with router(redis_url, max_file_bytes=limit, **overrides) as client:
            headers, body = multipart(content)
            del headers["content-length"]  # no refusal up front: cut while it arrives
            resp = await client.post("/v1/files", content=body, headers=headers)
            assert resp.status_code == 413, resp.text
            assert resp.json()["error"]["code"] == "request_too_large"
            assert file_keys(redis_client) == []
            assert list(tmp_path.iterdir()) == []
            assert (await client.get("/v1/files")).json()["data"] == []

    run(main(), timeout_s=60)


@pytest.mark.parametrize("in_dir", [False, True], ids=["redis", "files-dir"])
def test_a_store_that_fails_midway_leaves_nothing_and_its_partial_key_expires(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, in_dir: bool
) -> None:
    """FileStore.store on its own: a file that goes over the limit only in its third piece, a source
    that raises after two pieces, and a store cancelled while it waits for a piece (a client gone)
    each leave no key and no file; while a store runs, its partial key expires on its own."""
    piece = b"y" * CHUNK_BYTES

    async def main() -> None:
        async with redis_conn(redis_url) as r:
            files = FileStore(r, KEYS, max_bytes=2 * CHUNK_BYTES, directory=tmp_path if in_dir else None)
            seen_ttl: list[int] = []

            async def pieces(
                n: int, fail: bool = False, wait: asyncio.Event | None = None
            ) -> AsyncIterator[bytes]:
                for _ in range(n):
                    yield piece
                    if not in_dir:
                        seen_ttl.extend(
                            redis_client.pttl(k) for k in redis_client.scan_iter(match="*:partial")
                        )
                    else:
                        assert len(list(tmp_path.glob(".file-*.tmp"))) == 1
                if wait is not None:
                    wait.set()
                    await asyncio.Event().wait()  # never comes: the caller is cancelled
                if fail:
                    raise ConnectionResetError("the client went away")

            with pytest.raises(InvalidRequestError) as e:
                await files.store("big.jsonl", "batch", pieces(3))
            assert e.value.param == "file" and str(2 * CHUNK_BYTES) in e.value.message
            assert file_keys(redis_client) == [] and list(tmp_path.iterdir()) == []

            with pytest.raises(ConnectionResetError):
                await files.store("cut.jsonl", "batch", pieces(2, fail=True))
            assert file_keys(redis_client) == [] and list(tmp_path.iterdir()) == []

            waiting = asyncio.Event()
            task = asyncio.create_task(files.store("gone.jsonl", "batch", pieces(1, wait=waiting)))
            await waiting.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert file_keys(redis_client) == [] and list(tmp_path.iterdir()) == []

            if not in_dir:  # each piece set the partial key to expire (a router that dies leaves nothing)
                assert seen_ttl and all(0 < ttl <= 600_000 for ttl in seen_ttl), seen_ttl

                async def lost() -> AsyncIterator[bytes]:  # the partial key expires between two pieces
                    yield piece
                    for key in redis_client.scan_iter(match="*:partial"):
                        redis_client.delete(key)
                    yield piece

                with pytest.raises(ControlPlaneError, match="lost part of file"):
                    await files.store("lost.jsonl", "batch", lost())
                assert file_keys(redis_client) == []

            # output files (pdserve's own) may be larger than the upload limit, stored in pieces too
            info = await files.create("out.jsonl", "batch_output", piece * 3 + b"z")
            assert info.bytes == 3 * CHUNK_BYTES + 1
            _, size, parts = await files.open(info.id)
            assert size == info.bytes
            assert [len(p) async for p in parts] == [CHUNK_BYTES] * 3 + [1]

    run(main(), timeout_s=60)


def test_an_upload_takes_a_slot_and_is_refused_when_the_router_is_full(
    redis_url: str, redis_client: redis.Redis
) -> None:
    content = jsonl(CHUNK_BYTES)

    async def main() -> None:
        async with router(redis_url, max_in_flight=1, max_queued=0) as client:
            admission = state_of(client).admission
            await admission.enter()  # a generation runs: the router's one slot is taken
            headers, body = multipart(content)
            refused = await client.post("/v1/files", content=body, headers=headers)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            assert refused.headers["retry-after"]
            assert file_keys(redis_client) == []
            admission.leave()

            # an upload in progress holds the slot: a second one is refused meanwhile
            go = asyncio.Event()

            async def slow() -> AsyncIterator[bytes]:
                _, inner = multipart(content)
                async for part in inner:
                    yield part
                    await go.wait()

            headers, _ = multipart(content)
            first = asyncio.create_task(client.post("/v1/files", content=slow(), headers=headers))
            while admission.in_use == 0:
                await asyncio.sleep(0.01)
            headers, body = multipart(b"{}\n")
            assert (await client.post("/v1/files", content=body, headers=headers)).status_code == 429
            go.set()
            done = await first
            assert done.status_code == 200, done.text
            assert admission.in_use == 0
            got = await client.get(f"/v1/files/{done.json()['id']}/content")
            assert got.content == content

    run(main(), timeout_s=60)
