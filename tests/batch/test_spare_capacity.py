"""The batch worker's spare-capacity gate: how many lines may be in flight for a live set, and
whether Redis has room for their outcomes above the part of its memory kept for serving."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis
from batch_support import with_runner

from pdserve.batch import spare_capacity
from pdserve.batch.reaper import Reaper
from pdserve.batch.runner import BatchRunner
from pdserve.batch.spare_capacity import SpareCapacity
from pdserve.localredis.embedded import EmbeddedRedis
from pdserve.scheduler.redis_server import SERVING_RESERVE_MIN_BYTES
from pdserve.scheduler.registration import InstanceInfo
from pdserve.scheduler.registry import InstanceRegistry
from pdserve.worker.presence import load_info
from tests.router_support import instance, run
from tests.splitwise_support import pair, settle


def info(
    instance_id: str, role: str, running: int = 0, waiting: int = 0, background: int = 0, **kw
) -> InstanceInfo:
    i = instance(instance_id, role, running=running, waiting=waiting, **kw)
    i.load.background = background
    i.max_num_seqs = 16
    return i


GATE = SpareCapacity(state=None, max_load=0.5, concurrency=8, busy_concurrency=2)  # type: ignore[arg-type]


def test_idle_instances_take_the_full_concurrency() -> None:
    assert GATE.limit([info("m", "mixed")], "tiny") == 8
    assert GATE.limit([info("p", "prefill"), info("d", "decode", running=5, background=5)], "tiny") == 8


def test_online_work_anywhere_lowers_it() -> None:
    assert GATE.limit([info("m", "mixed", running=3, background=2)], "tiny") == 2
    assert GATE.limit([info("p", "prefill", waiting=1), info("d", "decode")], "tiny") == 2


def test_no_room_means_none() -> None:
    full = info("m", "mixed", running=6, waiting=2, background=8)  # 8 of 16 held: max_load 0.5
    assert GATE.limit([full], "tiny") == 0
    assert GATE.limit([info("p", "prefill"), info("d", "decode", running=8, background=8)], "tiny") == 0
    assert GATE.limit([info("p", "prefill")], "tiny") == 0  # a prefill instance alone cannot finish a line
    assert GATE.limit([info("m", "mixed", draining=True)], "tiny") == 0
    assert GATE.limit([info("m", "mixed", model="other")], "tiny") == 0
    assert GATE.limit([full, info("m2", "mixed")], "tiny") == 8


def test_a_pd_stack_running_only_batch_lines_takes_the_full_concurrency(redis_url: str) -> None:
    """A prefill instance's hand-offs in flight are no online work: the heartbeat's load of a P/D
    pair whose only work is a batch line, its prefill done and its KV on the way to decode, lets the
    gate send as many lines as a mixed instance running that line would (they counted as
    ``waiting`` once, and every P/D stack ran its batches at ``busy_concurrency``)."""

    def heartbeat(inst, role: str) -> InstanceInfo:
        i = instance(inst.id, role)
        i.load = load_info(inst.engine.load, inst.handler.handing_off())
        i.max_num_seqs = 16
        return i

    async def main() -> None:
        async with pair(redis_url) as (p, prefill, decode):
            line = p.request(list(range(1, 11))).model_copy(update={"background": True})
            await p.send(prefill, line)
            await prefill.receive()
            await prefill.step()  # prefilled: the hand-off is all that is left on P
            assert prefill.handler.handing_off() == 1
            loads = [heartbeat(prefill, "prefill"), heartbeat(decode, "decode")]
            assert loads[0].load.handing_off == 1
            assert GATE.limit(loads, "tiny") == GATE.limit(
                [info("m", "mixed", running=1, background=1)], "tiny"
            )
            assert GATE.limit(loads, "tiny") == 8
            await settle(prefill, decode)  # the line finishes; nothing is left behind
            assert prefill.handler.handing_off() == 0

    run(main())


def test_lines_wait_while_redis_is_into_its_serving_reserve(
    private_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An idle mixed instance has room for a line; once Redis's use reaches into the part of its
    maxmemory kept for serving, the line waits (its outcome would crowd out heartbeats and request
    streams), and goes on when there is room again."""
    monkeypatch.setattr(spare_capacity, "ROOM_CHECK_S", 0.0)
    admin = redis.Redis.from_url(private_redis.url)

    async def never_stopped() -> bool:
        return False

    async def admitted_within(gate: SpareCapacity, key: str, seconds: float) -> bool | None:
        async def go() -> bool:
            async with gate.admit("tiny", never_stopped, key) as admitted:
                return admitted

        try:
            return await asyncio.wait_for(go(), seconds)
        except TimeoutError:
            return None

    async def main(runner: BatchRunner, reaper: Reaper) -> None:
        store = runner.batches
        await InstanceRegistry(store.redis, store.keys, ttl_s=30).register(info("m", "mixed"))
        key = store.keys.batch_results("batch_room")
        assert await admitted_within(runner.capacity, key, 5) is True
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", used + SERVING_RESERVE_MIN_BYTES - (1 << 20))  # 1 MiB into it
        assert await admitted_within(runner.capacity, key, 1) is None
        admin.config_set("maxmemory", 0)
        assert await admitted_within(runner.capacity, key, 5) is True

    try:
        with caplog.at_level(logging.INFO, logger="pdserve.batch.spare_capacity"):
            with_runner(private_redis.url, main)
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
    waits = [r.getMessage() for r in caplog.records if "batch lines wait" in r.getMessage()]
    assert len(waits) == 1 and "kept for serving" in waits[0], waits
    assert any("batch lines go on" in r.getMessage() for r in caplog.records)
