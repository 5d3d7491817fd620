"""The worker's KV transports: one writer per decode peer, reopened when the peer restarts; and the
service offering, advertising and closing whatever backends the table holds, naming none."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any, ClassVar

import numpy as np
import pytest
from router_support import instance

from pdserve.cache_transfer.base import KVTransport, LocalCache, TransportBackend
from pdserve.cache_transfer.transports import TRANSPORTS
from pdserve.engine.config import EngineConfig
from pdserve.errors import ConfigError
from pdserve.worker.kv_writers import Transports
from pdserve.worker.service import WorkerService
from pdserve.worker.settings import WorkerSettings


class CountingWriter(KVTransport):
    protocol = "counting"

    def __init__(self, peer: Any) -> None:
        self.peer, self.closed = peer, False

    def write(self, src: np.ndarray, segments: list[tuple[int, int, int]]) -> int:
        return sum(n for _, _, n in segments)

    def close(self) -> None:
        self.closed = True


class CountingBackend(TransportBackend):
    """A transport that moves nothing and remembers what it was asked."""

    protocol = "counting"
    instances: ClassVar[list[CountingBackend]] = []

    def __init__(self) -> None:
        self.local: LocalCache | None = None
        self.writers: list[CountingWriter] = []
        self.closed = False
        self.instances.append(self)

    def open(self, local: LocalCache) -> None:
        self.local = local

    def endpoint(self) -> dict[str, Any] | None:
        return {"bytes": self.local.view.nbytes} if self.local is not None else None

    def writer(self, peer: Any) -> KVTransport:
        self.writers.append(CountingWriter(peer))
        return self.writers[-1]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def counting(monkeypatch):
    monkeypatch.setitem(TRANSPORTS, "counting", CountingBackend)
    CountingBackend.instances.clear()
    return CountingBackend


def test_one_writer_per_peer_reopened_when_its_endpoint_changes(counting) -> None:
    backend = counting()
    transports = Transports({"counting": backend})
    first = transports.get("counting", "d0", {"endpoint": {"counting": {"session": 1}}})
    assert transports.get("counting", "d0", {"endpoint": {"counting": {"session": 1}}}) is first
    restarted = transports.get("counting", "d0", {"endpoint": {"counting": {"session": 2}}})
    assert restarted is not first and first.closed and restarted.peer == {"session": 2}
    other = transports.get("counting", "d1", {"endpoint": {"counting": {"session": 1}}})
    assert other is not restarted
    transports.drop("d0")  # after a failure: the next hand-off reopens it
    assert restarted.closed and transports.get("counting", "d0", {"endpoint": {"counting": {"session": 2}}})
    transports.close()
    assert all(w.closed for w in backend.writers) and not backend.closed  # writers only
    transports.close_backends()
    assert backend.closed and transports.backends == {}


def test_a_peer_restarted_under_the_same_endpoint_gets_a_new_writer(counting) -> None:
    transports = Transports({"counting": counting()})
    endpoint = {"counting": "pdserve-d0"}  # shm: the segment's name is the same after a restart
    first = transports.get("counting", "d0", {"endpoint": endpoint, "incarnation": "a"})
    assert transports.get("counting", "d0", {"endpoint": endpoint, "incarnation": "a"}) is first
    restarted = transports.get("counting", "d0", {"endpoint": endpoint, "incarnation": "b"})
    assert restarted is not first and first.closed and not restarted.closed


def test_writers_of_departed_or_stale_peers_are_closed_after_their_last_write(counting) -> None:
    transports = Transports({"counting": counting()})
    d0 = transports.get("counting", "d0", {"endpoint": {"counting": "e0"}})
    d1 = transports.get("counting", "d1", {"endpoint": {"counting": "e1"}})
    with transports.writer("counting", "d0", {"endpoint": {"counting": "e0"}}) as held:
        assert held is d0 and transports.prune(["d0"]) == ["d0"]
        assert not d0.closed  # a write holds it: closed when that write is done
    assert d0.closed and not d1.closed and transports.peers == ["d1"]
    d1.current = lambda: False  # type: ignore[method-assign]  # its endpoint leads elsewhere now
    assert transports.prune() == ["d1"] and d1.closed and transports.peers == []


def test_the_housekeeping_closes_writers_of_peers_no_longer_registered(redis_url, tmp_path, counting) -> None:
    service = WorkerService(service_settings(redis_url, tmp_path, "prefill", "counting"))
    service.transports.backends["counting"] = counting()
    live = service.transports.get("counting", "d0", {"endpoint": {"counting": "e0"}})
    gone = service.transports.get("counting", "d1", {"endpoint": {"counting": "e1"}})

    async def prune() -> None:
        await service.registry.register(instance("d0", "decode"))
        try:
            await service._prune_writers()
        finally:
            await service.redis.aclose()

    asyncio.run(prune())
    assert gone.closed and not live.closed and service.transports.peers == ["d0"]


def service_settings(redis_url: str, tmp_path, role: str, kv_transfer: str) -> WorkerSettings:
    return WorkerSettings(
        model_dir=tmp_path,
        role=role,
        redis_url=redis_url,
        cluster=f"tr{uuid.uuid4().hex[:6]}",
        ttl_s=3.0,
        engine_kind="echo",
        instance_id=f"{role}-{uuid.uuid4().hex[:6]}",
        kv_transfer=kv_transfer,
        engine=EngineConfig(num_blocks=16),
    )


async def registered(service: WorkerService, part: str = "transfer") -> dict[str, Any]:
    """The service's transfer registration (or another ``part``) while it runs; it is drained and
    stopped after."""
    task = asyncio.create_task(service.run())
    try:
        for _ in range(400):
            info = await service.registry.get(service.id)
            if info is not None:
                return getattr(info, part).model_dump()
            assert not task.done(), task.exception()
            await asyncio.sleep(0.05)
        raise AssertionError("the worker did not register")
    finally:
        service.begin_drain()
        await asyncio.wait_for(task, 30)


def test_a_decode_instance_advertises_each_backend_it_opened_and_closes_them(
    redis_url, tmp_path, counting
) -> None:
    service = WorkerService(service_settings(redis_url, tmp_path, "decode", "counting"))
    transfer = asyncio.run(registered(service))
    (backend,) = counting.instances
    assert backend.local is not None and backend.local.shm_name == f"pdserve-{service.id}"
    local = backend.local
    assert (local.device, local.shared, local.block_bytes) == ("cpu", True, service.engine.facts.block_bytes)
    assert transfer == {
        "protocols": ["counting"],
        "endpoint": {"counting": {"bytes": backend.local.view.nbytes}},
        "incarnation": service.incarnation,
        "writes": ["counting"],
    }
    assert backend.closed and service.transports.backends == {}


def test_shm_on_decode_is_the_segment_a_prefill_offers_without_an_endpoint(redis_url, tmp_path) -> None:
    """Every instance with transports open writes over them (``writes``: peers fetch from it); only
    one whose cache is shared (a decode instance, a ``--switchable`` one) has an endpoint (peers
    write into it); a mixed one is never paired (no ``protocols``)."""
    decode = WorkerService(service_settings(redis_url, tmp_path, "decode", "shm"))
    assert asyncio.run(registered(decode)) == {
        "protocols": ["shm"],
        "endpoint": {"shm": f"pdserve-{decode.id}"},
        "incarnation": decode.incarnation,
        "writes": ["shm"],
    }
    prefill = WorkerService(service_settings(redis_url, tmp_path, "prefill", "shm"))
    assert asyncio.run(registered(prefill)) == {
        "protocols": ["shm"],
        "endpoint": None,
        "incarnation": prefill.incarnation,
        "writes": ["shm"],
    }
    mixed = WorkerService(service_settings(redis_url, tmp_path, "mixed", "both"))
    assert asyncio.run(registered(mixed)) == {
        "protocols": [],
        "endpoint": None,
        "incarnation": mixed.incarnation,
        "writes": None,
    }
    fetchable = WorkerService(
        dataclasses.replace(service_settings(redis_url, tmp_path, "mixed", "shm"), switchable=True)
    )
    assert asyncio.run(registered(fetchable)) == {
        "protocols": [],
        "endpoint": {"shm": f"pdserve-{fetchable.id}"},
        "incarnation": fetchable.incarnation,
        "writes": ["shm"],
    }
    restarted = WorkerService(decode.settings)  # the same id, started again
    assert restarted.incarnation != decode.incarnation


class GpuCountingBackend(CountingBackend):
    """A transport for caches in GPU memory (as cuda_ipc), remembering the options it was given."""

    protocol = "gpu-counting"
    devices = ("cuda",)
    options: ClassVar[dict[str, Any]] = {}

    @classmethod
    def from_options(cls, options: Any) -> GpuCountingBackend:
        cls.options = dict(options)
        return cls()


def on_a_gpu(monkeypatch) -> None:
    """The echo engine, saying its cache is on a GPU (what the torch engine's facts say there)."""
    from pdserve.engine.echo import EchoEngine

    facts = EchoEngine.facts

    def gpu_facts(self):
        return dataclasses.replace(
            facts(self), device="cuda", device_name="NVIDIA H200 (cuda:0)", memory_bytes=3 << 30
        )

    monkeypatch.setattr(EchoEngine, "facts", gpu_facts)


def test_a_gpu_instance_registers_its_device_and_hands_it_to_its_transports(
    redis_url, tmp_path, monkeypatch
) -> None:
    """The registration says where the cache lives (the router pairs only like with like), and the
    transports get the device in their options and their LocalCache."""
    monkeypatch.setitem(TRANSPORTS, "gpu-counting", GpuCountingBackend)
    on_a_gpu(monkeypatch)
    CountingBackend.instances.clear()
    service = WorkerService(service_settings(redis_url, tmp_path, "prefill", "gpu-counting"))
    kv = asyncio.run(registered(service, "kv"))
    assert (kv["device"], kv["device_name"], kv["memory_bytes"]) == ("cuda", "NVIDIA H200 (cuda:0)", 3 << 30)
    (backend,) = CountingBackend.instances
    assert (backend.local.device, backend.local.shared) == ("cuda", False)  # a prefill's: not exported
    assert GpuCountingBackend.options["device"] == "cuda"


def test_a_cpu_instance_registers_a_cpu_cache(redis_url, tmp_path, counting) -> None:
    service = WorkerService(service_settings(redis_url, tmp_path, "prefill", "counting"))
    kv = asyncio.run(registered(service, "kv"))
    assert (kv["device"], kv["device_name"], kv["memory_bytes"]) == ("cpu", None, None)


def test_a_gpu_instance_asked_for_shm_stops_at_start_and_says_why(redis_url, tmp_path, monkeypatch) -> None:
    on_a_gpu(monkeypatch)
    service = WorkerService(service_settings(redis_url, tmp_path, "decode", "shm"))
    with pytest.raises(
        ConfigError, match="--kv-transfer shm: the shm transport copies KV caches in host memory"
    ):
        asyncio.run(service.run())


def test_a_prefill_instance_publishes_the_time_its_hand_offs_took_per_block(
    redis_url, tmp_path, counting
) -> None:
    """The rate a hand-off's write measured (``Transports.observe``, what pacing reads) is published
    per transport as seconds per block in the registration's ``rates``; none before the first."""
    service = WorkerService(service_settings(redis_url, tmp_path, "prefill", "counting"))

    async def main() -> tuple[Any, Any]:
        task = asyncio.create_task(service.run())
        try:
            while (before := await service.registry.get(service.id)) is None:
                assert not task.done(), task.exception()
                await asyncio.sleep(0.05)
            block_bytes = service.engine.facts.block_bytes
            service.transports.observe("counting", 4 * block_bytes, 0.02)  # 4 blocks in 20 ms
            await service._push_heartbeat()
            after = await service.registry.get(service.id)
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
        return before, after

    before, after = asyncio.run(main())
    assert before.rates is None  # the echo engine measures no prefill; nothing was handed off
    assert after.rates is not None and after.rates.transfer_s_per_block == {"counting": pytest.approx(0.005)}
