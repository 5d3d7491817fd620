"""``pdserve status --watch`` under a pseudo-terminal: a live view of a real stack that shows every
live instance and router, redraws, and exits 0 on Ctrl-C; readable at 80 columns; in a pipe, one
plain snapshot per interval."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from tests.e2e.test_serving import start_stack

pytestmark = pytest.mark.timeout(120)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def read_until(fd: int, done, timeout_s: float) -> str:
    """What the terminal got until ``done(text)`` holds (or the time is up)."""
    out = b""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
            if done(ANSI.sub("", out.decode(errors="replace"))):
                break
    return ANSI.sub("", out.decode(errors="replace"))


def test_watch_shows_every_live_instance(tiny_model_dir, redis_url) -> None:
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=2, engine_kind="echo")
    try:
        main, child = pty.openpty()
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 220, 0, 0))
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "status",
                "--watch",
                "0.3",
                "--redis-url",
                redis_url,
                "--cluster",
                stack.spec.cluster,
            ],
            stdin=child,
            stdout=child,
            stderr=child,
            env={**os.environ, "TERM": "xterm-256color"},
            close_fds=True,
        )
        os.close(child)
        try:
            ids = stack.instance_ids
            assert len(ids) == 3

            def complete(text: str) -> bool:
                return all(i in text for i in ids) and text.count("cluster ") >= 3  # redrawn twice

            text = read_until(main, complete, 30)
            for instance_id in ids:
                assert instance_id in text, text[-3000:]
            assert text.count("cluster ") >= 3, "the view was not refreshed"
            assert "decode" in text and "prefill" in text and "KV USED" in text and "ROUTER" in text
            assert "router-" in text  # the router's id
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(main)
    finally:
        assert stack.stop(grace_s=15) == []


def register(redis_url: str, cluster: str, *infos) -> None:
    """Registrations as workers write them (TTL 30 s), without starting workers."""
    import asyncio

    from pdserve.scheduler import InstanceRegistry, Keys, RedisSettings

    async def run() -> None:
        redis = RedisSettings.from_url(redis_url).connect()
        try:
            for info in infos:
                await InstanceRegistry(redis, Keys(cluster), ttl_s=30).register(info)
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_watch_fits_80_columns(redis_url) -> None:
    """At 80 columns every instance id, role and state is whole (no ellipsis) and no line is wider."""
    import asyncio

    from rich.console import Console
    from router_support import instance

    from pdserve.status_read import collect
    from pdserve.status_watch import view

    ids = ("prefill-0-1a2b3c", "decode-0-4d5e6f", "mixed-0-7a8b9c")
    register(
        redis_url,
        "w80",
        *(instance(i, i.split("-")[0], draining=i.startswith("d"), running=12, free_blocks=7) for i in ids),
    )
    console = Console(width=80, record=True, force_terminal=False)
    console.print(view(asyncio.run(collect(redis_url, "w80")), None, console.width))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "…" not in text, text
    for i in ids:
        assert i in text and i.split("-")[0] in text, text
    assert "draining" in text and "ready" in text and "KV USED" in text, text


def test_watch_in_a_pipe_prints_a_snapshot_per_interval(redis_url) -> None:
    """With stdout a pipe (no terminal to redraw) --watch prints the plain table every interval."""
    from router_support import instance

    register(redis_url, "wpipe", instance("mixed-0-abc123", "mixed"))
    cmd = [sys.executable, "-m", "pdserve.cli", "status", "--watch", "0.3", "--redis-url", redis_url]
    proc = subprocess.Popen([*cmd, "--cluster", "wpipe"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        text = read_until(proc.stdout.fileno(), lambda t: t.count("cluster wpipe") >= 2, 30)
        assert text.count("cluster wpipe: 1 instance(s)") >= 2, text  # one snapshot per interval
        assert "INSTANCE" in text and "mixed-0-abc123" in text, text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_watch_shows_the_batches(redis_url, redis_client) -> None:
    """The batches panel: ids, statuses and counts whole at 80 columns; the endpoint when wide."""
    import asyncio

    from rich.console import Console

    from pdserve.status_read import batch_queue, collect
    from pdserve.status_watch import view
    from tests.test_cli import make_batches

    running, done = make_batches(redis_url, "wbatch", finished=1)
    assert batch_queue(redis_url, "wbatch") is not None
    status = asyncio.run(collect(redis_url, "wbatch"))
    for width in (80, 140):
        console = Console(width=width, record=True, force_terminal=False)
        console.print(view(status, None, console.width))
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= width and "…" not in text, text
        assert "batches: 1 active, 1 recently final; queue: 1 job(s) waiting" in text, text
        (row,) = [line for line in text.splitlines() if running in line]
        assert "in_progress" in row and "1/1/3" in row, text
        assert done[0] in text
        assert ("/v1/chat/completions" in row) == (width == 140), text


def test_status_says_which_instances_run_int8_weights(redis_url) -> None:
    import asyncio

    from router_support import instance

    from pdserve.status_read import collect
    from pdserve.status_table import render

    f32, int8 = instance("decode-0-aaaaaa", "decode"), instance("decode-1-bbbbbb", "decode")
    int8.kv.weights = "int8"
    register(redis_url, "wts", f32, int8)
    status = asyncio.run(collect(redis_url, "wts"))
    assert {i["id"]: i["weights"] for i in status["instances"]} == {f32.id: "f32", int8.id: "int8"}
    lines = {line.split()[0]: line for line in render(status).splitlines() if line.startswith("decode-")}
    assert f"{int8.model} (int8)" in lines[int8.id] and "(int8)" not in lines[f32.id]


def test_status_shows_each_instances_device_dtype_and_memory(redis_url) -> None:
    """One compact DEVICE cell: where the KV cache lives, its element type and the device memory
    held; a worker that registers no device (older, or a CPU one) is cpu. In --watch, only from
    150 columns on (narrower, the other columns stay whole)."""
    import asyncio

    from rich.console import Console
    from router_support import instance

    from pdserve.status_read import collect
    from pdserve.status_table import render
    from pdserve.status_watch import view

    cpu, gpu = instance("decode-0-aaaaaa", "decode"), instance("decode-1-bbbbbb", "decode")
    gpu.kv.device, gpu.kv.dtype, gpu.kv.device_name = "cuda", "bfloat16", "NVIDIA H200 (cuda:0)"
    gpu.kv.memory_bytes = 71 * 2**30 + 2**29
    register(redis_url, "wdev", cpu, gpu)
    status = asyncio.run(collect(redis_url, "wdev"))
    by_id = {i["id"]: i for i in status["instances"]}
    assert (by_id[gpu.id]["device"], by_id[gpu.id]["device_name"]) == ("cuda", "NVIDIA H200 (cuda:0)")
    assert (by_id[cpu.id]["device"], by_id[cpu.id]["memory_bytes"]) == ("cpu", None)
    text = render(status)
    assert "DEVICE" in text.splitlines()[2]
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("decode-")}
    assert "cuda bf16 71.5G" in lines[gpu.id] and "cpu f32" in lines[cpu.id]
    for width in (80, 140, 160):
        console = Console(width=width, record=True, force_terminal=False)
        console.print(view(status, None, console.width))
        shown = console.export_text()
        assert max(len(line) for line in shown.splitlines()) <= width and "…" not in shown, shown
        assert ("cuda bf16 71.5G" in shown) == (width == 160), shown


def test_status_shows_a_prefill_instances_hand_offs_after_its_waiting_requests(redis_url) -> None:
    """KV hand-offs in flight are their own field of the load report (no online work for the batch
    gate, but a prefill instance's work all the same): status shows them beside WAIT, in both views."""
    import asyncio

    from rich.console import Console
    from router_support import instance

    from pdserve.status_read import collect
    from pdserve.status_table import render
    from pdserve.status_watch import view

    busy, idle = instance("prefill-0-aaaaaa", "prefill", waiting=1), instance("prefill-1-bbbbbb", "prefill")
    busy.load.handing_off = 3
    register(redis_url, "handoffs", busy, idle)
    status = asyncio.run(collect(redis_url, "handoffs"))
    assert {i["id"]: i["handing_off"] for i in status["instances"]} == {busy.id: 3, idle.id: 0}
    lines = {line.split()[0]: line for line in render(status).splitlines() if line.startswith("prefill-")}
    assert "1 +3 kv" in lines[busy.id] and "kv" not in lines[idle.id].replace("KV", "")
    console = Console(width=80, record=True, force_terminal=False)
    console.print(view(status, None, console.width))
    text = console.export_text()
    assert "1 +3 kv" in text and max(len(line) for line in text.splitlines()) <= 80, text


def test_status_shows_each_host_tier(redis_url) -> None:
    """An instance with a host tier (--kv-host-bytes) gets a line with its size and counters; one
    without gets none."""
    import asyncio

    from router_support import instance

    from pdserve.scheduler import IdleCpuInfo, RatesInfo, TierInfo
    from pdserve.status_read import collect
    from pdserve.status_table import render

    plain, tiered = instance("mixed-0-aaaaaa", "mixed"), instance("mixed-1-bbbbbb", "mixed")
    tiered.tier = TierInfo(
        capacity_bytes=64 << 20, used_bytes=16 << 20, blocks=23, stores=30, hits=12, misses=5, evictions=7
    )
    tiered.rates = RatesInfo(prefill_s_per_token=0.002, host_read_s_per_block=0.0001)
    tiered.cpu = IdleCpuInfo(cpus=2.0, idle=0.4, threads=1)
    register(redis_url, "wtier", plain, tiered)
    status = asyncio.run(collect(redis_url, "wtier"))
    assert {i["id"]: bool(i["tier"]) for i in status["instances"]} == {plain.id: False, tiered.id: True}
    # the rates it measured, as --json prints them (what the routers' prefix_cache weighs)
    rates = {i["id"]: i["rates"] for i in status["instances"]}
    assert rates[plain.id] is None and rates[tiered.id] == {
        "prefill_s_per_token": 0.002,
        "decode_s_per_token": None,
        "host_read_s_per_block": 0.0001,
        "disk_read_s_per_block": None,
        "transfer_s_per_block": None,
        "fetch_s_per_block": None,
    }
    # the host's idle CPUs it said (what the planner's rule weighs before moving it)
    assert {i["id"]: i["cpu"] for i in status["instances"]} == {
        plain.id: None,
        tiered.id: {"cpus": 2.0, "idle": 0.4, "threads": 1},
    }
    lines = [line for line in render(status).splitlines() if line.startswith("host tier")]
    assert lines == [
        f"host tier {tiered.id}: 16/64 MiB, 23 blocks; read back 12, missed 5 (71% hit), stored 30, "
        "evicted 7, corrupt 0"
    ]


def test_status_shows_the_pool_host_and_disk_tiers_of_an_instance(redis_url) -> None:
    """An instance with a disk tier gets a line per tier: its pool's hit rate and evictions, and
    the disk tier's size, hit rate, evictions and its shared id."""
    import asyncio

    from router_support import instance

    from pdserve.scheduler import DiskTierInfo, PoolInfo
    from pdserve.status_read import collect
    from pdserve.status_table import render

    disked = instance("mixed-2-cccccc", "mixed")
    disked.pool = PoolInfo(hits=30, lookups=120, evictions=44)
    disked.disk_tier = DiskTierInfo(
        id="ab" * 16,
        path="/var/kv/x",
        capacity_bytes=1 << 30,
        used_bytes=256 << 20,
        blocks=700,
        stores=800,
        hits=60,
        misses=30,
        evictions=100,
        dropped=2,
    )
    register(redis_url, "wdisk", disked)
    status = asyncio.run(collect(redis_url, "wdisk"))
    lines = [
        line for line in render(status).splitlines() if line.startswith(("pool", "disk tier", "host tier"))
    ]
    assert lines == [
        f"pool {disked.id}: {disked.kv.num_blocks} blocks, 0 cached; 25% hit (30/120 blocks), evicted 44",
        f"disk tier {disked.id} (abababab): 256/1024 MiB, 700 blocks; read back 60, missed 30 (67% hit), "
        "stored 800, evicted 100, corrupt 0, dropped 2",
    ]


def test_status_shows_an_instances_peer_fetches(redis_url) -> None:
    """An instance that fetched prefix blocks from peers (or served them) gets a line with what came,
    what was computed instead and why; one that did neither gets none."""
    import asyncio

    from router_support import instance

    from pdserve.scheduler import FetchInfo
    from pdserve.status_read import collect
    from pdserve.status_table import render

    plain, fetching = instance("mixed-3-dddddd", "mixed"), instance("mixed-4-eeeeee", "mixed")
    fetching.fetch = FetchInfo(fetches=4, hits=90, misses=10, failed=1, mismatches=1, served=7)
    register(redis_url, "wfetch", plain, fetching)
    status = asyncio.run(collect(redis_url, "wfetch"))
    assert {i["id"]: i["fetch"] for i in status["instances"]}[plain.id] is None
    lines = [line for line in render(status).splitlines() if line.startswith("peer fetch")]
    assert lines == [
        f"peer fetch {fetching.id}: fetched 90 blocks, missed 10 (90% hit); 1 of 4 fetches fell back "
        "(1 mismatched); served 7 blocks to peers"
    ]
