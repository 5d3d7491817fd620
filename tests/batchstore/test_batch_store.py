"""The Batch API's stores on a real Redis: the batch record's compare-and-set, each line written
once, listing and expiry, files in Redis or in a folder, and chunk leases."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis_support import run

from pdserve.batchstore.batches import BatchObject, BatchStore, window_seconds
from pdserve.batchstore.files import FileStore
from pdserve.batchstore.reindex import reindex
from pdserve.errors import InvalidRequestError, NotFoundError
from pdserve.scheduler import Keys

KEYS = Keys("batch-test")
CHAT = "/v1/chat/completions"


async def started(store: BatchStore, total: int = 0, chunks: int = 0, chunk_lines: int = 0) -> BatchObject:
    """A new batch moved to ``in_progress``, as the validating job leaves it."""
    batch = await store.create("file-abc", CHAT, "24h", {"team": "a"})
    moved = await store.update(
        batch.id, ("validating",), status="in_progress", total=total, chunks=chunks, chunk_lines=chunk_lines
    )
    assert moved is not None
    return moved


# ---- update: the compare-and-set ----------------------------------------------------------------
def test_racing_updates_end_in_exactly_one_status(redis_url: str, redis_client: redis.Redis) -> None:
    """A finalize and a cancel racing from in_progress: one wins, the other sees None."""

    async def main(r: aioredis.Redis) -> tuple[BatchObject | None, BatchObject | None, BatchObject]:
        store = BatchStore(r, KEYS)
        batch = await started(store)
        fin, cancel = await asyncio.gather(
            store.update(batch.id, ("in_progress",), status="finalizing", finalizing_at=1),
            store.update(batch.id, ("in_progress",), status="cancelling", cancelling_at=2),
        )
        return fin, cancel, await store.get(batch.id)

    for _ in range(5):  # whichever wins, the loser changed nothing
        fin, cancel, now = run(redis_url, main)
        assert (fin is None) != (cancel is None), (fin, cancel)
        winner = fin or cancel
        assert winner is not None and now.status == winner.status
        assert (now.finalizing_at, now.cancelling_at) == ((1, None) if fin else (None, 2))


def test_an_unexpected_status_changes_nothing(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        store = BatchStore(r, KEYS)
        batch = await store.create("file-abc", CHAT, "24h", None)
        before = redis_client.get(KEYS.batch(batch.id))
        got = await store.update(batch.id, ("in_progress", "finalizing"), status="completed", completed_at=9)
        assert got is None
        assert redis_client.get(KEYS.batch(batch.id)) == before
        assert (await store.get(batch.id)).status == "validating"
        assert batch.id in await store.active()
        assert await store.update("batch_none", ("validating",), status="failed") is None  # no record

    run(redis_url, main)


def test_a_final_status_leaves_the_active_set_and_starts_the_expiry(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """A non-final change keeps the batch active and its keys lasting; a final one drops it from the
    active set, gives its record and line hashes the store's TTL, and forgets its chunk jobs."""
    ids: dict[str, str] = {}

    async def main(r: aioredis.Redis) -> None:
        store = BatchStore(r, KEYS, ttl_s=60)
        batch = await started(store, total=2, chunks=1, chunk_lines=2)
        ids["id"] = batch.id
        await store.set_chunk_jobs(batch.id, {0: "job-0"})
        await store.record(batch.id, 0, {"ok": 1}, error=False)
        await store.record(batch.id, 1, {"bad": 1}, error=True)
        assert await store.update(batch.id, ("in_progress",), status="cancelling") is not None
        keys = (KEYS.batch(batch.id), KEYS.batch_results(batch.id), KEYS.batch_errors(batch.id))
        assert [redis_client.ttl(k) for k in keys] == [-1, -1, -1]  # cancelling is not final
        assert redis_client.sismember(KEYS.active_batches, batch.id)
        assert await store.chunk_jobs(batch.id) == {0: "job-0"}

        assert await store.update(batch.id, ("cancelling",), status="cancelled", cancelled_at=5) is not None
        assert all(0 < redis_client.ttl(k) <= 60 for k in keys), [redis_client.ttl(k) for k in keys]
        assert not redis_client.sismember(KEYS.active_batches, batch.id)
        assert not redis_client.exists(KEYS.batch_chunks(batch.id))
        got = await store.get(batch.id)
        assert got.final and got.status == "cancelled" and got.cancelled_at == 5
        assert got.metadata == {"team": "a"}  # the record survives the script's JSON round trip

    run(redis_url, main)
    assert ids["id"] not in run(redis_url, lambda r: BatchStore(r, KEYS).active())


# ---- record: each line once ---------------------------------------------------------------------
def test_each_line_is_recorded_once(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        store = BatchStore(r, KEYS)
        batch = await started(store, total=12)
        assert await store.record(batch.id, 3, {"first": True}, error=False)
        assert not await store.record(batch.id, 3, {"second": True}, error=False)
        assert not await store.record(batch.id, 3, {"as error": True}, error=True)  # nor in the other hash
        assert await store.record(batch.id, 4, {"e": 4}, error=True)
        assert not await store.record(batch.id, 4, {"r": 4}, error=False)
        assert redis_client.hgetall(KEYS.batch_results(batch.id)) == {b"3": b'{"first":true}'}
        assert redis_client.hgetall(KEYS.batch_errors(batch.id)) == {b"4": b'{"e":4}'}
        counts = (await store.get(batch.id)).request_counts
        assert (counts.total, counts.completed, counts.failed) == (12, 1, 1)

    run(redis_url, main)


@pytest.mark.parametrize("final", ["completed", "expired", "cancelled", "failed"])
def test_a_final_batch_records_no_more_lines(redis_url: str, redis_client: redis.Redis, final: str) -> None:
    """A line answered after its batch is final (its output files written) is dropped: recorded, it
    would count in ``request_counts`` but be in no output file. Nor is a line of a batch with no
    record (expired, or never made) written: its hashes would be left without a TTL."""

    async def main(r: aioredis.Redis) -> None:
        store = BatchStore(r, KEYS)
        batch = await started(store, total=3)
        assert await store.record(batch.id, 0, {"ok": 0}, error=False)
        assert await store.update(batch.id, ("in_progress",), status="cancelling")
        assert await store.record(batch.id, 1, {"late but not final": 1}, error=True)  # still counts
        assert await store.update(batch.id, ("cancelling",), status=final)
        assert not await store.record(batch.id, 2, {"too late": 2}, error=False)
        assert not await store.record(batch.id, 2, {"too late": 2}, error=True)
        counts = (await store.get(batch.id)).request_counts
        assert (counts.total, counts.completed, counts.failed) == (3, 1, 1)
        assert await store.done_lines(batch.id) == {0, 1}
        assert not await store.record("batch_none", 0, {"ok": 0}, error=False)
        assert not redis_client.exists(KEYS.batch_results("batch_none"))

    run(redis_url, main)


def test_outcomes_come_in_numeric_line_order(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        store = BatchStore(r, KEYS)
        batch = await started(store, total=12)
        for line in (10, 2, 9, 0, 11):
            await store.record(batch.id, line, {"line": line}, error=False)
        for line in (8, 1):
            await store.record(batch.id, line, {"line": line}, error=True)
        assert await store.done_lines(batch.id) == {0, 1, 2, 8, 9, 10, 11}
        out, err = await store.outcomes(batch.id)
        assert out == [b'{"line":%d}' % n for n in (0, 2, 9, 10, 11)]  # 10 after 9, not after 1
        assert err == [b'{"line":1}', b'{"line":8}']
        counts = (await store.get(batch.id)).request_counts
        assert (counts.completed, counts.failed) == (5, 2)

    run(redis_url, main)


# ---- create, list, windows ----------------------------------------------------------------------
def test_create_starts_validating_and_active(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        store = BatchStore(r, KEYS)
        batch = await store.create("file-abc", CHAT, "30m", None)
        assert batch.status == "validating" and batch.expires_at - batch.created_at == 1800
        assert await store.active() == [batch.id]
        got = await store.get(batch.id)
        assert got.model_dump() == batch.model_dump()

    run(redis_url, main)


def test_list_is_newest_first_pages_and_drops_expired(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        store = BatchStore(r, KEYS, ttl_s=1)
        made = []
        for _ in range(3):
            made.append((await store.create("file-abc", CHAT, "24h", None)).id)
            await asyncio.sleep(0.005)  # distinct creation milliseconds (the index's score)
        first, second, third = made
        page, more = await store.list_batches(limit=2)
        assert [b.id for b in page] == [third, second] and more
        page, more = await store.list_batches(after=second, limit=2)
        assert [b.id for b in page] == [first] and not more
        page, more = await store.list_batches(limit=3)
        assert len(page) == 3 and not more
        assert await store.list_batches(after="batch_unknown") == ([], False)

        assert await store.update(second, ("validating",), status="failed", failed_at=1) is not None
        await asyncio.sleep(1.3)  # its record's TTL (1 s) runs out
        page, more = await store.list_batches()
        assert [b.id for b in page] == [third, first] and not more
        assert redis_client.zscore(KEYS.owner_batches(""), second) is None  # dropped from the index
        assert redis_client.zcard(KEYS.owner_batches("")) == 2

    run(redis_url, main)


@pytest.mark.parametrize(
    ("window", "seconds"), [("24h", 86400), ("30m", 1800), ("1d", 86400), ("7d", 604800)]
)
def test_completion_window_accepts_durations(window: str, seconds: int) -> None:
    assert window_seconds(window) == seconds


@pytest.mark.parametrize("window", ["0h", "8d", "abc", "24 hours", "", "-1h", "24"])
def test_completion_window_refuses_others(window: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        window_seconds(window)
    assert e.value.param == "completion_window"


def test_get_unknown_or_malformed_batch_is_not_found(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        store = BatchStore(r, KEYS)
        for batch_id in ("batch_nope", "bad id", "a:b", "{x}", ""):
            with pytest.raises(NotFoundError):
                await store.get(batch_id)

    run(redis_url, main)


# ---- leases -------------------------------------------------------------------------------------
def test_a_lease_is_held_until_released_or_expired(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        store = BatchStore(r, KEYS)
        batch = await started(store, total=6, chunks=3, chunk_lines=2)
        assert await store.leased_chunks(batch) == set()
        await store.hold_lease(batch.id, 0, "worker-a", ttl_ms=10_000)
        await store.hold_lease(batch.id, 2, "worker-b", ttl_ms=300)
        assert await store.leased_chunks(batch) == {0, 2}
        await asyncio.sleep(0.5)  # chunk 2's worker stopped renewing
        assert await store.leased_chunks(batch) == {0}
        await store.hold_lease(batch.id, 1, "worker-c", ttl_ms=10_000)
        await store.release_lease(batch.id, 0)
        assert await store.leased_chunks(batch) == {1}
        assert list(batch.chunk_range(2)) == [4, 5]

    run(redis_url, main)


# ---- files --------------------------------------------------------------------------------------
def test_a_file_in_redis_expires_with_its_metadata(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        files = FileStore(r, KEYS, ttl_s=120)
        info = await files.create("in.jsonl", "batch", b'{"a":1}\n')
        assert info.bytes == 8 and info.expires_at == info.created_at + 120
        assert await files.content(info.id) == b'{"a":1}\n'
        assert await files.get(info.id) == info
        for key in (KEYS.file(info.id), KEYS.file_content(info.id)):
            assert 0 < redis_client.ttl(key) <= 120
        assert (await files.list_files()) == ([info], False)
        await files.delete(info.id)
        assert not redis_client.exists(KEYS.file(info.id), KEYS.file_content(info.id))
        assert redis_client.zcard(KEYS.owner_files("")) == 0

    run(redis_url, main)


def test_a_file_in_a_directory_keeps_its_bytes_out_of_redis(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    async def main(r: aioredis.Redis) -> None:
        files = FileStore(r, KEYS, directory=tmp_path)
        info = await files.create("in.jsonl", "batch", b"line\n")
        path = tmp_path / f"{info.id}.jsonl"
        assert path.read_bytes() == b"line\n"
        assert not redis_client.exists(KEYS.file_content(info.id))
        assert redis_client.exists(KEYS.file(info.id))
        assert await files.content(info.id) == b"line\n"
        await files.delete(info.id)
        assert not path.exists() and not redis_client.exists(KEYS.file(info.id))
        with pytest.raises(NotFoundError):
            await files.get(info.id)

    run(redis_url, main)


def test_listing_drops_expired_files_and_their_folder_copies(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    async def main(r: aioredis.Redis) -> None:
        short = FileStore(r, KEYS, ttl_s=1, directory=tmp_path)
        gone = await short.create("old.jsonl", "batch", b"old\n")
        kept = await FileStore(r, KEYS, directory=tmp_path).create("new.jsonl", "batch", b"new\n")
        await asyncio.sleep(1.3)
        assert (tmp_path / f"{gone.id}.jsonl").exists()  # until a listing meets it
        found, more = await short.list_files()
        assert [f.id for f in found] == [kept.id] and not more
        assert not (tmp_path / f"{gone.id}.jsonl").exists()
        assert (tmp_path / f"{kept.id}.jsonl").exists()
        assert redis_client.zscore(KEYS.owner_files(""), gone.id) is None

    run(redis_url, main)


def test_a_file_over_the_limit_is_refused(redis_url: str, redis_client: redis.Redis) -> None:
    async def main(r: aioredis.Redis) -> None:
        files = FileStore(r, KEYS, max_bytes=10)
        with pytest.raises(InvalidRequestError) as e:
            await files.create("big.jsonl", "batch", b"x" * 11)
        assert e.value.param == "file" and "10" in e.value.message
        assert redis_client.zcard(KEYS.owner_files("")) == 0
        assert (await files.create("ok.jsonl", "batch", b"x" * 10)).bytes == 10
        # the limit is for uploads: an output file pdserve writes is stored whatever its size
        assert (await files.create("out.jsonl", "batch_output", b"x" * 30)).bytes == 30

    run(redis_url, main)


@pytest.mark.parametrize("in_folder", [False, True])
def test_unknown_or_malformed_file_ids_are_not_found(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, in_folder: bool
) -> None:
    """A bad id is a 404 like any unknown one, not the key builder's ValueError (a 400/500)."""

    async def main(r: aioredis.Redis) -> None:
        files = FileStore(r, KEYS, directory=tmp_path if in_folder else None)
        for file_id in ("file-nope", "bad id", "a:b", "{x}", "", "../x"):
            for call in (files.get, files.content, files.delete):
                with pytest.raises(NotFoundError):
                    await call(file_id)

    run(redis_url, main)


def test_the_old_shared_indexes_move_into_each_owners_own(redis_url: str, redis_client: redis.Redis) -> None:
    """Files and batches listed in the one index of everyone's (before each owner had its own) are
    listed and counted under their owner once a router has started; the old indexes are gone."""
    owner = "c" * 32

    async def main(r: aioredis.Redis) -> None:
        files, store = FileStore(r, KEYS), BatchStore(r, KEYS)
        info = await files.create("in.jsonl", "batch", b"{}\n" * 10, owner)
        batch = await store.create(info.id, CHAT, "24h", None, owner=owner)
        done = await store.create(info.id, CHAT, "24h", None, owner=owner)
        assert await store.update(done.id, ("validating",), status="failed", failed_at=1)
        for key in (KEYS.owner(owner) + suffix for suffix in (":files", ":files:expiry", ":files:bytes")):
            await r.delete(key)  # as a file made before: in the shared index only
        await r.delete(KEYS.owner_batches(owner), KEYS.owner_active(owner), KEYS.owners)
        await r.zadd(KEYS.files, {info.id: 1000.0})
        await r.zadd(KEYS.batches, {batch.id: 1000.0, done.id: 1001.0})
        assert await files.list_files(owner=owner) == ([], False)

        assert await reindex(r, KEYS) == 3
        assert await reindex(r, KEYS) == 0  # once
        assert [f.id for f in (await files.list_files(owner=owner))[0]] == [info.id]
        assert [b.id for b in (await store.list_batches(owner=owner))[0]] == [done.id, batch.id]
        usage = await files.owners.usage(owner)
        assert (usage.files, usage.bytes, usage.batches) == (1, 30, 1), usage
        assert not await r.exists(KEYS.files, KEYS.batches)

    run(redis_url, main)
