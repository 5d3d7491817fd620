"""Shared memory that cleans up after itself and never SIGBUSes.

A decode instance's segment is locked by its owner for life, so the sweeper removes exactly the
segments of dead owners; a /dev/shm too small for a cache is a clear error at start; a cache that
fits has its pages committed, so /dev/shm filling up later cannot SIGBUS it (Docker's and
Kubernetes' default /dev/shm is 64 MiB). The process-level tests run in a private mount namespace
with its own small tmpfs on /dev/shm (root, `unshare` and `nsenter`: CI has them), so they neither
see nor sweep the host's segments.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
from host_support import need_root_and

from pdserve.cache_transfer import shm
from pdserve.cache_transfer.base import LocalCache
from pdserve.errors import TransferError
from pdserve.localredis.embedded import free_port
from pdserve.scheduler import Keys

MiB = 1 << 20


def in_small_shm(*cmd: str, size: str = "8m") -> subprocess.CompletedProcess:
    need_root_and("unshare", required_by="PDSERVE_REQUIRE_MULTIHOST")  # a private mount namespace
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cmd],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class PrivateShm:
    """A mount namespace whose /dev/shm is a tmpfs of ``size``, kept by a sleeping process: commands
    run in it through ``nsenter``, and the test reads its /dev/shm through /proc/<pid>/root."""

    def __init__(self, size: str, logs: Path) -> None:
        need_root_and("unshare", "nsenter", required_by="PDSERVE_REQUIRE_MULTIHOST")
        script = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && echo ready && exec sleep 600"
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.holder.stdout.readline().strip() == "ready"
        self.dir = Path(f"/proc/{self.holder.pid}/root/dev/shm")
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def pdserve(self, name: str, *args: str) -> subprocess.Popen:
        """``pdserve *args`` inside the namespace (nsenter execs it: the Popen is the process itself)."""
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - the child writes it until it ends
        cmd = ["nsenter", "-t", str(self.holder.pid), "-m", "--", sys.executable, "-m", "pdserve.cli", *args]
        proc = subprocess.Popen(cmd, stderr=log, stdout=log, start_new_session=True)
        self.procs.append(proc)
        return proc

    def python(self, code: str) -> subprocess.CompletedProcess:
        cmd = ["nsenter", "-t", str(self.holder.pid), "-m", "--", sys.executable, "-c", code]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def segments(self) -> set[str]:
        return {n for n in os.listdir(self.dir) if n.startswith(shm.PREFIX)}

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.holder.kill()
        self.holder.wait()


@pytest.fixture
def private_shm(tmp_path):
    spaces: list[PrivateShm] = []
    yield lambda size: spaces.append(PrivateShm(size, tmp_path)) or spaces[-1]
    for space in spaces:
        space.close()


def wait_registered(client: redis.Redis, cluster: str, ids: list[str], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 90
    while not all(client.exists(Keys(cluster).instance(i)) for i in ids):
        for p in procs:
            assert p.poll() is None, f"{p.args[-12:]} exited with {p.returncode}"
        assert time.monotonic() < deadline, f"{ids} did not register"
        time.sleep(0.2)


def worker_args(
    role: str, model: Path | str, iid: str, redis_url: str, cluster: str, *more: str
) -> list[str]:
    return [
        "worker",
        "--role",
        role,
        "--model",
        str(model),
        "--instance-id",
        iid,
        "--redis-url",
        redis_url,
        "--cluster",
        cluster,
        "--ttl",
        "3",
        *more,
    ]


# ---- the ownership lock and the sweeper (this host's /dev/shm, names no one else uses) ------------------
@pytest.fixture
def prefix():
    """A name prefix of this test's own: the sweeps below look at nothing else in /dev/shm."""
    mine = f"{shm.PREFIX}test-{uuid.uuid4().hex[:8]}-"
    yield mine
    shm.sweep_dead_segments(mine)  # what a failed test left


def owner(name: str, nbytes: int = MiB) -> subprocess.Popen:
    """A process that creates ``name``, writes a byte into it, says so, and sleeps."""
    code = (
        "import sys, time\nfrom pdserve.cache_transfer.shm import create_segment\n"
        f"s = create_segment({name!r}, {nbytes}); s.buf[0] = 42\nprint('ready', flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.kill()
    assert proc.wait() == -signal.SIGKILL


def test_a_killed_owners_segment_is_swept_a_live_ones_is_kept(prefix) -> None:
    dead, alive = owner(prefix + "dead"), owner(prefix + "alive")
    try:
        writer = shm.ShmWriter(prefix + "dead")  # a prefill attached to it: it holds no lock
        assert bytes(writer._shm.buf[:1]) == b"\x2a"
        assert shm.sweep_dead_segments(prefix) == []  # both owners alive
        kill(dead)
        assert os.path.exists(f"{shm.SHM_DIR}/{prefix}dead")  # SIGKILL left it behind
        assert shm.sweep_dead_segments(prefix) == [prefix + "dead"]
        assert os.path.exists(f"{shm.SHM_DIR}/{prefix}alive") and not os.path.exists(
            f"{shm.SHM_DIR}/{prefix}dead"
        )
        writer.close()  # the mapping stayed usable until the attacher let go
        assert shm.sweep_dead_segments(prefix) == []
    finally:
        for p in (dead, alive):
            p.kill()
            p.wait()
    assert shm.sweep_dead_segments(prefix) == [prefix + "alive"]


def test_reclaiming_a_name_refuses_a_live_owner_and_takes_a_dead_ones(prefix) -> None:
    name = prefix + "decode-1"
    first = owner(name)
    try:
        with pytest.raises(TransferError, match="held by a live process"):
            shm.create_segment(name, MiB, reclaim=True)
        with pytest.raises(TransferError, match="already exists"):
            shm.create_segment(name, MiB)
        peek = shm.attach_segment(name)
        assert peek.buf[0] == 42  # untouched by the refusals
        peek.close()
    finally:
        kill(first)
    second = shm.create_segment(name, 2 * MiB, reclaim=True)  # the restarted instance
    assert second.buf[0] == 0 and os.stat(second.path).st_size == 2 * MiB + shm.FENCE_BYTES
    assert shm.sweep_dead_segments(prefix) == []  # ours now, and we are alive
    second.close()
    assert not os.path.exists(second.path)


def test_a_writer_knows_when_its_segment_name_leads_to_a_new_segment(prefix) -> None:
    """A decode instance restarted under its id makes a new segment of the same name: a writer
    mapped to the old one must be reopened (``worker/kv_writers.Transports``), never written through."""
    name = prefix + "decode-1"
    first = shm.create_segment(name, MiB)
    writer = shm.ShmWriter(name)
    assert writer.current()
    first.close()  # the first run's segment is gone (a dead run's is removed by the restart)
    assert not writer.current()
    second = shm.create_segment(name, MiB)  # the restarted instance: same name, another segment
    try:
        assert not writer.current()
        fresh = shm.ShmWriter(name)
        assert fresh.current()
        fresh.close()
    finally:
        writer.close()
        second.close()


def test_a_writer_reads_the_incarnation_of_the_segment_it_maps(prefix) -> None:
    """The fence after the cache names its owner's incarnation; a writer attached by name to a
    restarted owner's segment reads the new one, and the cache it writes ends before the fence."""
    name = prefix + "decode-2"
    first = shm.create_segment(name, MiB)
    writer = shm.ShmWriter(name)
    assert writer.fence() == ""  # no incarnation written yet
    shm.ShmBackend().open(LocalCache(first.buf, shm_name=name, shared=True, incarnation="one"))
    assert writer.fence() == "one"
    with pytest.raises(TransferError, match="exceeds"):
        writer.write(np.zeros(8, np.uint8), [(0, MiB - 4, 8)])  # the fence is not cache
    writer.close()
    first.close()
    second = shm.create_segment(name, MiB)
    try:
        shm.write_fence(name, "two")
        fresh = shm.ShmWriter(name)
        assert fresh.fence() == "two"
        fresh.close()
    finally:
        second.close()


def test_an_unlocked_file_is_swept_whatever_its_age(prefix) -> None:
    """No grace period: the creator locks before anything else and re-creates a file swept before
    its lock (create_segment), so the sweeper may remove any file it can lock, however new."""
    path = f"{shm.SHM_DIR}/{prefix}new"
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    assert shm.sweep_dead_segments(prefix) == [prefix + "new"] and not os.path.exists(path)


# ---- real workers in a private /dev/shm -----------------------------------------------------------------
def test_a_segment_larger_than_dev_shm_is_refused_up_front() -> None:
    code = (
        "from pdserve.cache_transfer.shm import create_segment\n"
        "from pdserve.errors import ConfigError\n"
        "small = create_segment('pdserve-test-fits', 4 << 20); small.close()\n"
        "try:\n    create_segment('pdserve-test-big', 16 << 20)\nexcept ConfigError as e:\n    print(e)\n"
        "import os; print(sorted(os.listdir('/dev/shm')))\n"
    )
    out = in_small_shm(sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    assert "/dev/shm cannot hold this instance's 16 MiB KV cache" in out.stdout and "--shm-size" in out.stdout
    assert out.stdout.strip().endswith("[]")  # neither the refused segment nor the closed one is left


def test_a_decode_worker_says_so_and_exits(redis_url, tmp_path) -> None:
    # 4096 echo blocks of 64 bytes fit; 1M blocks (64 MiB) do not
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "worker",
        "--role",
        "decode",
        "--engine",
        "echo",
        "--model",
        str(tmp_path),
        "--redis-url",
        redis_url,
        "--cluster",
        "shmtest",
        "--num-blocks",
        "1048576",
    ]
    out = in_small_shm(*cmd)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])  # a clear error, not -SIGBUS
    assert "cannot hold this instance's 64 MiB KV cache" in out.stderr and "--kv-cache-gb" in out.stderr


def test_a_restarted_decode_sweeps_the_killed_ones_segment(private_shm, redis_url, tmp_path) -> None:
    """SIGKILL leaves a decode's segment behind; the next decode worker to start (another id) removes
    it before it makes its own, and keeps a live instance's."""
    space, client = private_shm("64m"), redis.Redis.from_url(redis_url)
    cluster = f"sweep{uuid.uuid4().hex[:6]}"
    ids = {n: f"decode-{n}-{cluster}" for n in ("killed", "alive", "new")}
    procs = {
        n: space.pdserve(n, *worker_args("decode", tmp_path, i, redis_url, cluster, "--engine", "echo"))
        for n, i in ids.items()
        if n != "new"
    }
    wait_registered(client, cluster, [ids["killed"], ids["alive"]], list(procs.values()))
    assert space.segments() == {f"pdserve-{ids['killed']}", f"pdserve-{ids['alive']}"}
    kill(procs["killed"])
    assert f"pdserve-{ids['killed']}" in space.segments()  # nothing cleaned up after it
    procs["new"] = space.pdserve(
        "new", *worker_args("decode", tmp_path, ids["new"], redis_url, cluster, "--engine", "echo")
    )
    wait_registered(client, cluster, [ids["new"]], [procs["new"]])
    assert space.segments() == {f"pdserve-{ids['alive']}", f"pdserve-{ids['new']}"}
    assert f"removed shared memory segment pdserve-{ids['killed']}" in space.log("new")
    for n in ("alive", "new"):
        procs[n].send_signal(signal.SIGTERM)
        assert procs[n].wait(30) == 0, space.log(n)
    assert space.segments() == set()  # a drained decode removes its own


def test_a_decode_cache_larger_than_64_mib_fails_fast_with_the_flag(
    private_shm, redis_url, tiny_model_dir
) -> None:
    space = private_shm("64m")
    t0 = time.monotonic()
    iid = f"decode-big-{uuid.uuid4().hex[:6]}"
    args = worker_args("decode", tiny_model_dir, iid, redis_url, "shmbig", "--num-blocks", "2048")  # x 64 KiB
    proc = space.pdserve("big", *args)
    assert proc.wait(60) == 2, space.log("big")[-3000:]  # an error exit, not -SIGBUS
    err = space.log("big")
    assert "/dev/shm cannot hold this instance's 128 MiB KV cache (64 MiB free of 64 MiB" in err, err[-3000:]
    assert "--shm-size" in err and "--num-blocks" in err
    assert time.monotonic() - t0 < 60 and space.segments() == set()


def test_20_long_prompts_with_dev_shm_filled_up_after_start(private_shm, redis_url, tiny_model_dir) -> None:
    """A cache that fits has its pages committed at start: once the rest of /dev/shm is taken, the
    prefill's writes into the decode's segment still land (an uncommitted segment would SIGBUS)."""
    space, client = private_shm("64m"), redis.Redis.from_url(redis_url)
    cluster = f"full{uuid.uuid4().hex[:6]}"
    engine = ["--max-model-len", "1024", "--threads", "1", "--kv-transfer", "shm"]
    ids = {"decode": f"decode-{cluster}", "prefill": f"prefill-{cluster}"}
    blocks = {"decode": "512", "prefill": "256"}  # the decode's 512 blocks of 64 KiB: 32 MiB of the 64
    workers = {
        role: space.pdserve(
            role,
            *worker_args(
                role, tiny_model_dir, iid, redis_url, cluster, *engine, "--num-blocks", blocks[role]
            ),
        )
        for role, iid in ids.items()
    }
    port = free_port()
    router = space.pdserve(
        "router", "router", "--port", str(port), "--redis-url", redis_url, "--cluster", cluster
    )
    wait_registered(client, cluster, list(ids.values()), [*workers.values(), router])
    assert space.segments() == {f"pdserve-{ids['decode']}"}
    url = f"http://127.0.0.1:{port}/v1/completions"
    deadline = time.monotonic() + 30
    while httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code != 200:
        assert time.monotonic() < deadline and router.poll() is None, space.log("router")
        time.sleep(0.2)
    with open(space.dir / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while f.write(b"\1" * MiB):  # take every page of /dev/shm that is left, until ENOSPC
            pass
    assert os.statvfs(space.dir).f_bavail == 0
    with pytest.raises(OSError) as full:
        (space.dir / "more").write_bytes(b"x" * 4096)
    assert full.value.errno == errno.ENOSPC

    model = tiny_model_dir.resolve().name
    rng = random.Random(0)

    def ask(i: int) -> httpx.Response:
        prompt = [rng.randrange(10, 4000) for _ in range(1000)]  # + 16 tokens: close to the 1024 limit
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        return httpx.post(url, json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        replies = list(pool.map(ask, range(20)))
    for role, proc in workers.items():
        assert proc.poll() is None, f"{role} died: {proc.returncode}\n{space.log(role)[-3000:]}"
    for r in replies:
        assert r.status_code == 200, r.text
        assert r.headers["x-pdserve-mode"] == "splitwise", r.headers  # the KV went through the segment
        assert r.json()["usage"]["completion_tokens"] == 16
    for proc in (router, *workers.values()):
        proc.send_signal(signal.SIGTERM)
    for role, proc in workers.items():
        assert proc.wait(30) == 0, space.log(role)[-3000:]  # drained, never killed by a signal
    assert space.segments() == set()


def test_pdserve_up_sweeps_at_start_and_when_a_decode_child_dies(private_shm, redis_url, tmp_path) -> None:
    space = private_shm("64m")
    code = f"""
import os, subprocess, sys, time
from pdserve.cache_transfer import shm
from pdserve.localredis.embedded import free_port
from pdserve.stack import Stack, StackSpec

def spec(**counts):
    return StackSpec(model={str(tmp_path)!r}, redis_url={redis_url!r}, port=free_port(), cluster="up" + os.urandom(3).hex(),
                     ttl_s=3.0, engine_kind="echo", ready_timeout_s=60, **{{"prefill": 0, "decode": 0, "mixed": 0, **counts}})

dead = subprocess.Popen([sys.executable, "-c", "from pdserve.cache_transfer.shm import create_segment as c; "
                         "c('pdserve-left-by-a-killed-stack', 4096); print(flush=True); import time; time.sleep(60)"],
                        stdout=subprocess.PIPE)
dead.stdout.readline(); dead.kill(); dead.wait()
print("before", sorted(os.listdir("/dev/shm")))
stack = Stack(spec(mixed=1))  # a mixed worker sweeps nothing: what goes, the stack swept
stack.start()
print("started", sorted(os.listdir("/dev/shm")))
stack.stop()
stack = Stack(spec(decode=1))
stack.start()
stack.wait_ready()
name, proc = stack.workers[0]
print("ready", sorted(os.listdir("/dev/shm")))
proc.kill(); proc.wait()
print("killed", sorted(os.listdir("/dev/shm")))
stack.supervise()  # sees the exit; the restart is a second away
print("supervised", sorted(os.listdir("/dev/shm")), stack.restarts.get(name, 0))
stack.stop(grace_s=15)
"""
    out = space.python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["before"] == "['pdserve-left-by-a-killed-stack']" and lines["started"] == "[]"
    decode = lines["ready"].strip("[]'")
    assert decode.startswith("pdserve-decode-0-") and lines["killed"] == f"['{decode}']"
    assert lines["supervised"] == "[] 0", out.stderr[-3000:]  # gone before any restart
