"""--redis-wait-replicas on a real Sentinel deployment: what a router counted as sent survives a
failover. The replica is frozen (SIGSTOP) and its link cut so that replication stalls, the primary is SIGKILLed and
the replica promoted: sends acknowledged without WAIT are lost with the old primary, sends with
WAIT were never acknowledged (they failed, so the dispatcher retries them), and sends WAIT
acknowledged are all on the new primary."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from pdserve.errors import ControlPlaneError
from pdserve.localredis.embedded_ha import EmbeddedSentinel
from pdserve.router.routing.sender import InboxSender
from pdserve.scheduler import GenerateRequest, Keys, RedisSettings
from pdserve.scheduler.redis_client import RedisClient, ReplicaWait

pytestmark = pytest.mark.timeout(120)
KEYS = Keys("wait-test")
K = 20


def gen(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, router_id="r1", prompt="hi", deadline=time.time() + 60)


async def send_all(client: RedisClient, wait: ReplicaWait, prefix: str) -> set[str]:
    """Send K generates; return the request ids whose send was acknowledged."""
    sender = InboxSender(client, KEYS, wait=wait)
    ids = [f"{prefix}{i}" for i in range(K)]
    results = await asyncio.gather(*(sender.send("w0", gen(i)) for i in ids), return_exceptions=True)
    for r in results:
        assert r is None or isinstance(r, ControlPlaneError), r
    return {i for i, r in zip(ids, results, strict=True) if r is None}


async def inbox_ids(client: RedisClient) -> set[str]:
    entries = await client.xrange(KEYS.inbox("w0"))
    return {GenerateRequest.model_validate_json(fields[b"m"]).request_id for _, fields in entries}


def test_what_wait_acknowledged_survives_a_failover_and_what_it_did_not_was_never_acknowledged() -> None:
    sentinel = EmbeddedSentinel(replicas=1)
    sentinel.start()
    url = sentinel.url

    async def phase(stall: bool) -> tuple[set[str], set[str], set[str]]:
        """(acked without WAIT, acked with WAIT 1, present on the new primary)."""
        client = RedisSettings.from_url(url).connect()
        try:
            primary = sentinel.primary()
            replica = next(n for n in sentinel.nodes if n is not primary and n.proc is not None)
            if stall:  # the replica freezes and loses its link: the primary acks what no replica has
                replica.proc.send_signal(signal.SIGSTOP)
                await client.client_kill_filter(_type="replica")
            try:
                plain = await send_all(client, ReplicaWait(0), f"plain-{stall}-")
                waited = await send_all(
                    client, ReplicaWait(1, 2000), f"waited-{stall}-"
                )  # generous: a loaded CI host
                primary.stop(kill=True)
            finally:
                if stall:
                    replica.proc.send_signal(signal.SIGCONT)
            await asyncio.to_thread(sentinel.wait_for_failover, primary.port, 30)
            present = await inbox_ids(client)
            await asyncio.to_thread(sentinel.restart, primary)
            await client.delete(KEYS.inbox("w0"))
            return plain, waited, present
        finally:
            await client.aclose()

    try:
        plain, waited, present = asyncio.run(phase(stall=True))
        # without WAIT every send was acknowledged, and all of them were lost with the old primary
        assert len(plain) == K and not plain & present
        # with WAIT none was acknowledged (each failed: the dispatcher retries the request)
        assert waited == set()
        plain, waited, present = asyncio.run(phase(stall=False))
        assert len(waited) == K and waited <= present  # acknowledged by WAIT: none lost
        print(
            f"acknowledged and lost: without WAIT {K} of {K} (replica stalled); with WAIT 0 of {len(waited)}"
        )
    finally:
        sentinel.close()
