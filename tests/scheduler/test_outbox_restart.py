"""The outbox reader notices every restart and failover of the server behind one address, however
short: its lean connection is identified (``run_id``, replication ids) before each first round trip,
and nothing is trimmed on a server not identified yet. The client is made as a router makes it (its
``Retry`` reconnects within ~3 s), which used to reconnect the reader's read to the new server unseen.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from pdserve.localredis.embedded import EmbeddedRedis
from pdserve.scheduler import Keys, OutboxReader, RedisSettings
from pdserve.scheduler.messages import encode
from pdserve.scheduler.redis_client import ReplicaWait
from pdserve.scheduler.redis_server import server_identity
from pdserve.scheduler.streams import FIELD, Outbox
from tests.redis_support import one_delta_step as step
from tests.redis_support import seqs_until

pytestmark = pytest.mark.timeout(60)
KEYS = Keys("restart-test")
OUTBOX = KEYS.outbox("r1")


@pytest.mark.parametrize("gap_s", [0.3, 2.0])
def test_a_restart_however_short_fails_the_requests_in_flight(
    private_redis: EmbeddedRedis, gap_s: float
) -> None:
    """Redis is SIGKILLed and a new, empty one answers on the same port ``gap_s`` later: well within
    the client's reconnect retries. The request in flight gets control_plane_restarted at once (its
    events may be lost), not its first-token or stall timeout."""

    async def main() -> tuple[list[int | str], float]:
        client = RedisSettings.from_url(private_redis.url).connect()  # a router's settings and retries
        reader = OutboxReader(client, KEYS, "r1", fail_after_s=30)
        queue = reader.subscribe("a")
        try:
            async with reader:
                await Outbox(client, KEYS).publish("r1", step(0))
                assert await seqs_until(queue, 0, 5) == [0]
                private_redis.stop(kill=True)
                await asyncio.sleep(gap_s)
                await asyncio.to_thread(private_redis.start)
                answered = time.monotonic()
                return await seqs_until(queue, 1, 8), time.monotonic() - answered
        finally:
            await client.aclose()

    seqs, waited_s = asyncio.run(main())
    assert seqs == ["control_plane_restarted"], seqs
    assert waited_s < 3, waited_s


class SwitchProxy:
    """One address in front of Redis servers (a virtual IP, a Kubernetes Service): :meth:`switch`
    drops every link and sends new connections to another server, as a failover behind it does."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def switch(self, target_port: int) -> None:
        self.target_port = target_port
        for writer in list(self._links):
            writer.transport.abort()

    async def close(self) -> None:
        self.switch(0)
        if self._server is not None:
            self._server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._links |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
            except OSError:
                pass
            finally:
                dst.transport.abort()
                self._links.discard(dst)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def test_a_failover_behind_one_address_is_read_again_from_the_start_with_nothing_trimmed(
    private_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """With replica waits on (``trust_failover``): events 0-4 reach the replica; the replica is
    promoted; event 5 reaches only the old primary, under an id a minute ahead of the new one's
    clock, and the reader reads it (its trim of 5 goes out with its next read). The worker publishes
    5 again and 6-9 on the new primary, under lower ids; then the old primary dies and the address
    leads to the new one. The reader must read the outbox again from its start, and its pending trim
    (up to 5's id) must not run there: it would delete 5-9 before they are read."""
    (tmp_path / "b").mkdir()
    replica = EmbeddedRedis(
        workdir=tmp_path / "b", extra_args=["--replicaof", "127.0.0.1", str(private_redis.port)]
    )
    replica.start()

    async def main() -> tuple[list[int | str], int]:
        proxy = SwitchProxy(private_redis.port)
        await proxy.start()
        client = RedisSettings.from_url(proxy.url).connect()  # a router's settings and retries
        old = aioredis.Redis(port=private_redis.port)
        new = aioredis.Redis(port=replica.port)
        reader = OutboxReader(client, KEYS, "r1", fail_after_s=30, trust_failover=True)
        queue = reader.subscribe("a")
        try:
            while (await new.info("replication")).get("master_link_status") != "up":
                await asyncio.sleep(0.02)
            async with reader:
                waited = Outbox(client, KEYS, wait=ReplicaWait(1, 5000))
                for seq in range(5):
                    await waited.publish("r1", step(seq))
                assert await seqs_until(queue, 4, 5) == [0, 1, 2, 3, 4]
                before = await server_identity(old, OUTBOX)
                await new.execute_command("REPLICAOF", "NO", "ONE")
                assert (await server_identity(new, OUTBOX)).continues(before)
                ahead = f"{int(time.time() * 1000) + 60_000}-0"
                await old.xadd(OUTBOX, {FIELD: encode(step(5))}, id=ahead)
                assert await seqs_until(queue, 5, 5) == [5]
                republished = Outbox(new, KEYS)
                for seq in range(5, 10):
                    await republished.publish("r1", step(seq))
                private_redis.stop(kill=True)
                proxy.switch(replica.port)
                return await seqs_until(queue, 9, 8), reader.num_failovers
        finally:
            await client.aclose()
            await old.aclose()
            await new.aclose()
            await proxy.close()

    try:
        seqs, failovers = asyncio.run(main())
    finally:
        replica.stop(kill=True)
    assert [s for s in seqs if not isinstance(s, int) or s > 5] == [6, 7, 8, 9], seqs  # 0-5 again: dropped
    assert failovers == 1
