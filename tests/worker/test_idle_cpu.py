"""The idle CPU an instance publishes for the planner: a process spinning on one CPU shows as one
CPU fewer idle (the host's own counters, read while it spins), and a cgroup's quota bounds what is
idle by what the quota leaves (a container's limit, files shaped like cgroup v2's)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import uuid
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.planner.observe import Member
from pdserve.worker.idle_cpu import IdleCpuMeter, own_cgroup
from pdserve.worker.service import WorkerService
from pdserve.worker.settings import WorkerSettings


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_busy_cpu_is_not_idle(tmp_path: Path) -> None:
    meter = IdleCpuMeter(threads=1, root=tmp_path)  # no cpu.max there: the host's CPUs alone
    assert meter.sample() is None  # one sample says nothing yet
    cpus = len(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("spawn")
    spinner = ctx.Process(target=_spin, args=(3.0,))
    spinner.start()
    try:
        time.sleep(0.5)  # the child up and spinning
        meter.samples.clear()
        meter.sample()
        time.sleep(1.5)
        info = meter.sample()
    finally:
        spinner.join()
    assert info is not None and info.cpus == cpus and info.threads == 1
    # other work on the host only lowers idle further: the bound holds under any load
    assert 0.0 <= info.idle <= cpus - 0.7, info


def test_the_cgroup_quota_bounds_the_idle_cpus(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    stat = tmp_path / "cpu.stat"
    now = [0.0]
    meter = IdleCpuMeter(threads=2, root=tmp_path, clock=lambda: now[0])
    cpus = len(os.sched_getaffinity(0))
    assert meter.cpus == min(cpus, 1.5)
    stat.write_text("usage_usec 10000000\nuser_usec 9000000\n")
    assert meter.sample() is None
    now[0] = 4.0
    stat.write_text("usage_usec 14000000\nuser_usec 13000000\n")  # 4 CPU-s in 4 s: one CPU's worth
    info = meter.sample()
    assert info is not None and info.cpus == min(cpus, 1.5) and info.threads == 2
    assert info.idle <= 0.5  # whatever the host's CPUs did, the quota left half a CPU


def test_samples_older_than_the_window_are_dropped(tmp_path: Path) -> None:
    now = [0.0]
    meter = IdleCpuMeter(threads=1, root=tmp_path, clock=lambda: now[0])
    for t in range(0, 40, 2):
        now[0] = float(t)
        meter.sample()
    assert meter.samples[-1].at - meter.samples[0].at <= 12.0 and len(meter.samples) <= 7


@pytest.mark.skipif(not Path("/proc/self/cgroup").exists(), reason="no /proc/self/cgroup (not Linux)")
def test_own_cgroup_is_under_the_root(tmp_path: Path) -> None:
    assert own_cgroup(tmp_path).is_relative_to(tmp_path)


def test_a_cpu_worker_publishes_its_hosts_idle_cpus(tiny_model_dir, redis_url, cluster) -> None:
    """A real worker's registration, once its heartbeats are a second apart, says its CPUs, their
    idle share and its engine's threads: what the planner's rule reads (``Member.of``)."""

    async def run() -> None:
        service = WorkerService(
            WorkerSettings(
                model_dir=tiny_model_dir,
                role="decode",
                served_model_name="tiny",
                redis_url=redis_url,
                cluster=cluster,
                ttl_s=1.5,  # a heartbeat every 0.5 s
                engine_kind="model",
                instance_id=f"decode-{uuid.uuid4().hex[:6]}",
                engine=EngineConfig(num_blocks=32, max_model_len=256, threads=1),
            )
        )
        task = asyncio.create_task(service.run())
        deadline = time.monotonic() + 60
        try:
            while (info := await service.registry.get(service.id)) is None or info.cpu is None:
                assert not task.done(), task.exception()
                assert time.monotonic() < deadline, "no idle CPU published"
                await asyncio.sleep(0.1)
        finally:
            service.begin_drain()
            await asyncio.wait_for(task, 30)
        assert info.cpu.cpus == len(os.sched_getaffinity(0)) and info.cpu.threads == 1
        assert 0.0 <= info.cpu.idle <= info.cpu.cpus
        member = Member.of(info)
        assert (member.host, member.idle_cpus, member.threads) == (info.host, info.cpu.idle, 1)

    asyncio.run(run())
