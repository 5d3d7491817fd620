"""The outbox reader across a real Sentinel failover (a primary, a replica, three Sentinels).

With replica waits on (``trust_failover``) a promoted replica holds every event counted as sent, so
the reader fails nothing and reads on from the new primary: from the outbox's start, since an event
it read from the old primary but that was never replicated may come again under a lower id (the
new primary's clock behind the old one's). Without replica waits, and after a restart (a server
whose data does not continue the old primary's), every request in flight fails as before."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from pdserve.localredis.embedded import EmbeddedRedis
from pdserve.localredis.embedded_ha import EmbeddedSentinel
from pdserve.scheduler import Keys, OutboxReader, RedisSettings
from pdserve.scheduler.messages import encode
from pdserve.scheduler.redis_client import ReplicaWait
from pdserve.scheduler.redis_server import REDIS_OUTAGE_S, outage_limit_s, server_identity
from pdserve.scheduler.streams import FIELD, Outbox
from tests.redis_support import one_delta_step as step
from tests.redis_support import seqs_until

pytestmark = pytest.mark.timeout(120)
KEYS = Keys("failover-test")


def continued(seqs: list[int | str], next_seq: int) -> list[int | str]:
    """What a request expecting ``next_seq`` makes of ``seqs`` (RoutedGeneration._accept): repeats
    dropped, a gap noted, errors kept."""
    kept: list[int | str] = []
    for s in seqs:
        if isinstance(s, str):
            kept.append(s)
        elif s > next_seq:
            kept.append(f"gap before {s}")
        elif s == next_seq:
            kept.append(s)
            next_seq += 1
    return kept


async def publish(outbox: Outbox, seq: int, timeout_s: float = 30) -> None:
    """Publish as a worker does: again until Redis takes it (the new primary may not answer yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await outbox.publish("r1", step(seq))
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("trust_failover", [True, False])
def test_the_reader_reads_on_through_a_failover_when_replica_waits_are_on(trust_failover: bool) -> None:
    """Events 0-4 are published with WAIT 1 (replicated); the replica is frozen and cut off, and
    event 5 reaches only the primary, under an id a minute ahead (its clock ahead of the replica's);
    the reader reads it; the primary is SIGKILLed and the replica promoted; the worker publishes 5
    again (its WAIT had failed) and 6-9 on the new primary, under ids below 5's first one."""
    sentinel = EmbeddedSentinel(replicas=1)
    sentinel.start()

    async def main() -> list[int | str]:
        client = RedisSettings.from_url(sentinel.url, retries=1, connect_timeout_s=0.5).connect()
        reader = OutboxReader(
            client,
            KEYS,
            "r1",
            block_ms=100,
            fail_after_s=60,
            max_backoff_s=0.1,
            trust_failover=trust_failover,
        )
        waited = Outbox(client, KEYS, wait=ReplicaWait(1, 2000))
        queue = reader.subscribe("a")
        # routers and workers wait for Redis through a failover: the Sentinels' down-after on top
        assert await outage_limit_s(client, True) == REDIS_OUTAGE_S + sentinel.down_after_ms / 1000
        assert await outage_limit_s(client, False) == REDIS_OUTAGE_S
        try:
            async with reader:
                for seq in range(5):
                    await waited.publish("r1", step(seq))
                assert await seqs_until(queue, 4, 10) == [0, 1, 2, 3, 4]
                before = await server_identity(client, KEYS.outbox("r1"))
                primary = sentinel.primary()
                replica = next(n for n in sentinel.nodes if n is not primary)
                assert replica.proc is not None
                replica.proc.send_signal(signal.SIGSTOP)
                try:
                    await client.client_kill_filter(_type="replica")
                    ahead = f"{int(time.time() * 1000) + 60_000}-0"
                    await client.xadd(KEYS.outbox("r1"), {FIELD: encode(step(5))}, id=ahead)
                    assert await seqs_until(queue, 5, 10) == [5]
                    primary.stop(kill=True)
                finally:
                    replica.proc.send_signal(signal.SIGCONT)
                await asyncio.to_thread(sentinel.wait_for_failover, primary.port, 30)
                after = await server_identity(client, KEYS.outbox("r1"))
                assert after.run_id != before.run_id and after.continues(before)
                plain = Outbox(client, KEYS)  # no replica is left to wait for
                for seq in range(5, 10):
                    await publish(plain, seq)
                return await seqs_until(queue, 9, 20)
        finally:
            await client.aclose()

    try:
        seqs = asyncio.run(main())
    finally:
        sentinel.close()
    if trust_failover:  # read on, from the outbox's start (repeats are the request's to drop)
        assert continued(seqs, 6) == [6, 7, 8, 9], seqs
    else:  # events may have been lost: every request in flight fails (retryably) as before
        assert seqs[-1] == "control_plane_restarted", seqs


def test_a_restarted_server_is_no_failover_even_with_replica_waits(private_redis: EmbeddedRedis) -> None:
    """A server that comes back empty (its run_id new, no replication history continued) still
    fails every request in flight with control_plane_restarted."""

    async def main() -> list[int | str]:
        client = RedisSettings.from_url(private_redis.url, retries=0, connect_timeout_s=0.2).connect()
        reader = OutboxReader(
            client, KEYS, "r1", block_ms=100, fail_after_s=30, max_backoff_s=0.05, trust_failover=True
        )
        queue = reader.subscribe("a")
        try:
            async with reader:
                await Outbox(client, KEYS).publish("r1", step(0))
                assert await seqs_until(queue, 0, 5) == [0]
                private_redis.stop(kill=True)
                private_redis.start()
                return await seqs_until(queue, 1, 10)
        finally:
            await client.aclose()

    assert asyncio.run(main()) == ["control_plane_restarted"]


def test_a_restart_within_the_clients_retries_is_seen_through_sentinel_too() -> None:
    """Through Sentinel the reader reads with redis-py's pipelines, whose retries reconnect a lost
    connection (a router's settings): the primary back empty 0.3 s after a SIGKILL, before the
    Sentinels see it down, is reached within them. The read carries the run_id it expects, so the
    request in flight still fails with control_plane_restarted (and nothing is trimmed there)."""
    sentinel = EmbeddedSentinel(replicas=1)
    sentinel.start()

    async def main() -> list[int | str]:
        client = RedisSettings.from_url(sentinel.url).connect()  # a router's settings and retries
        reader = OutboxReader(client, KEYS, "r1", fail_after_s=60, trust_failover=True)
        queue = reader.subscribe("a")
        try:
            async with reader:
                await Outbox(client, KEYS).publish("r1", step(0))
                assert await seqs_until(queue, 0, 10) == [0]
                primary = sentinel.primary()
                primary.stop(kill=True)
                await asyncio.sleep(0.3)
                await asyncio.to_thread(primary.start)
                return await seqs_until(queue, 1, 8)
        finally:
            await client.aclose()

    try:
        seqs = asyncio.run(main())
    finally:
        sentinel.close()
    assert seqs == ["control_plane_restarted"], seqs
