"""The ``pdserve`` command line as a new user meets it: help that explains itself, flags anywhere."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cli import build_parser, main
from pdserve.stack_record import record_path, running_stack

COMMANDS = ("model", "generate", "worker", "router", "batch-worker", "up", "redis", "status", "role", "plan")


def subcommands(parser):
    (action,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return action.choices


def test_every_command_has_a_description() -> None:
    subs = subcommands(build_parser())
    assert set(COMMANDS) <= set(subs)
    for name in COMMANDS:
        assert subs[name].description, f"`pdserve {name} --help` has no description"
    assert subcommands(subs["model"])["init"].description


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["--log-level", "WARNING", "status"], "WARNING"),
        (["status", "--log-level", "debug"], "DEBUG"),
        (["worker", "--model", "m", "--log-level", "ERROR"], "ERROR"),
        (["model", "init", "x", "--log-level", "DEBUG"], "DEBUG"),
    ],
)
def test_log_level_goes_before_or_after_the_command(argv: list[str], level: str) -> None:
    assert build_parser().parse_args(argv).log_level == level


def test_version(capsys) -> None:
    import pdserve

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"pdserve {pdserve.__version__}\n"


def test_role_lists_its_choices(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["worker", "--role", "prefil"])
    assert e.value.code == 2
    assert "choose from prefill, decode, mixed" in capsys.readouterr().err.replace("'", "")


def test_status_without_a_stack_record_uses_the_default_url(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert running_stack() is None
    record_path().write_text(json.dumps({"pid": 2**22 + 12345, "redis_url": "redis://x:1/0"}))
    assert running_stack() is None  # that process is gone: a stale record is ignored
    record_path().write_text(json.dumps({"pid": os.getpid(), "redis_url": "redis://x:1/0"}))
    assert running_stack()["redis_url"] == "redis://x:1/0"


def test_status_finds_the_live_stack_among_several_records(tmp_path, monkeypatch) -> None:
    """Two `pdserve up` recorded (one file each); the newer one has exited: status finds the other."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    dead, live = record_path(2**22 + 12345), record_path()
    dead.write_text(json.dumps({"pid": 2**22 + 12345, "redis_url": "redis://dead:1/0"}))
    live.write_text(json.dumps({"pid": os.getpid(), "redis_url": "redis://live:1/0"}))
    os.utime(live, (1e9, 1e9))  # the live stack started first: the exited one's record is newer
    assert running_stack()["redis_url"] == "redis://live:1/0"
    assert dead.exists() and live.exists()  # records are read, never taken over


def test_status_reads_the_redis_of_a_running_stack(tmp_path, monkeypatch, redis_url, capsys) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    record_path().write_text(json.dumps({"pid": os.getpid(), "redis_url": redis_url, "cluster": "c9"}))
    assert main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "c9"


def test_redis_command_refuses_a_taken_port() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "redis", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2 and "try --port" in out.stderr and "Traceback" not in out.stderr


def test_up_refuses_a_taken_router_port_before_starting_anything(tmp_path) -> None:
    """The second router's port is taken: `up` says which port and which flag, and starts nothing."""
    import socket

    from pdserve.localredis.embedded import free_port

    base = free_port(count=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 1))
        s.listen()
        out = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "up", "--port", str(base), "--routers", "2"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path)},
        )
    assert out.returncode == 2, out.stderr
    assert f"port {base + 1}" in out.stderr and "--port" in out.stderr and "Traceback" not in out.stderr
    assert "embedded Redis" not in out.stdout


def test_redis_command_stops_its_server_on_sigterm_and_wants_a_password_beyond_loopback() -> None:
    import signal
    import socket
    import time

    from pdserve.localredis.embedded import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "redis", "--port", str(port), "--password", "pw"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while "serving at redis://:***@127.0.0.1" not in (line := proc.stderr.readline()):
        assert line and time.monotonic() < deadline, "no startup line"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # the redis-server child went with it
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "redis", "--bind", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "give it a --password" in out.stderr


def documented_flag_table() -> list[tuple[list[str], list[str], list[str]]]:
    """(variables, flags, commands) per row of docs/operations.md's flag table."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    table = text[text.index("## Flags and environment variables") :].split("\n## ")[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`PDSERVE_"):
            continue
        variables = re.findall(r"`(PDSERVE_\w+)`", cells[0])
        if cells[1] == "same":
            flags = ["--" + v.removeprefix("PDSERVE_").lower().replace("_", "-") for v in variables]
        else:
            flags = re.findall(r"`(--[\w-]+)`", cells[1])
        commands = list(COMMANDS) if cells[2] == "all" else [c.strip() for c in cells[2].split(",")]
        rows.append((variables, flags, commands))
    return rows


def command_helps() -> dict[str, str]:
    subs = subcommands(build_parser())
    helps = {name: " ".join(subs[name].format_help().split()) for name in COMMANDS}
    helps["model"] += " " + " ".join(subcommands(subs["model"])["init"].format_help().split())
    return helps


def test_documented_flag_table_matches_help() -> None:
    """Each row of docs/operations.md's flag table names flags that exist, with their variable, on the
    commands it names; and every PDSERVE_* variable that some --help mentions has a row naming that
    command."""
    helps = command_helps()
    documented: set[tuple[str, str]] = set()
    for variables, flags, commands in documented_flag_table():
        if not flags:
            continue  # variables read outside argparse (PDSERVE_CACHE_DIR, PDSERVE_TEST_REDIS_URL)
        for command in commands:
            for flag, var in zip(flags, variables, strict=True):
                assert re.search(rf"{re.escape(flag)}\b", helps[command]), f"{command} has no {flag}"
                documented.add((command, var))
    missing = sorted(
        f"{var} for `pdserve {command}`"
        for command, text in helps.items()
        for var in set(re.findall(r"\[env (PDSERVE_\w+)\]", text))
        if (command, var) not in documented
    )
    assert not missing, f"docs/operations.md's flag table lacks {missing}"


def parse_worker(argv: list[str]):
    from pdserve.engine.config import EngineConfig
    from pdserve.flags import from_args
    from pdserve.worker.settings import WorkerSettings

    args = build_parser().parse_args(["worker", *argv])
    return from_args(WorkerSettings, args, engine=from_args(EngineConfig, args))


def test_settings_survive_the_trip_through_a_child_command_line(tmp_path, monkeypatch) -> None:
    """What `pdserve up` decides reaches each child exactly, whatever the child's environment says."""
    from pdserve.engine.config import EngineConfig
    from pdserve.flags import to_argv
    from pdserve.router.http.settings import RouterSettings, settings_from_args
    from pdserve.worker.settings import WorkerSettings

    engine = EngineConfig(num_blocks=64, block_size=8, max_model_len=512, threads=2, kernels="composed")
    worker = WorkerSettings(
        model_dir=tmp_path, role="decode", redis_url="redis://h:1/2", ttl_s=3.0, engine=engine
    )
    router = RouterSettings(port=9001, reserve_timeout_s=2.5, access_log=True, prefill_policy="random")
    for name, value in (
        ("BLOCK_SIZE", "32"),
        ("TTL", "9"),
        ("ROLE", "prefill"),
        ("ACCESS_LOG", "0"),
        ("PORT", "1"),
    ):
        monkeypatch.setenv(f"PDSERVE_{name}", value)
    assert parse_worker(to_argv(worker)) == worker
    assert settings_from_args(build_parser().parse_args(["router", *to_argv(router)])) == router
    assert parse_worker(["--model", str(tmp_path)]).engine.block_size == 32  # the environment is the default


def test_a_bad_setting_is_a_cli_error_naming_the_flag(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["worker", "--model", str(tmp_path), "--ttl", "0"])
    assert exc.value.code == 2 and "--ttl must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["up", "--prefill", "1", "--decode", "0"])
    assert "--prefill needs --decode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["worker"])
    assert "--model is required" in capsys.readouterr().err


def test_status_check_is_a_health_check(redis_url, capsys) -> None:
    import asyncio

    from router_support import instance

    from pdserve.scheduler import InstanceRegistry, Keys, RedisSettings

    async def register(info) -> None:
        redis = RedisSettings.from_url(redis_url).connect()
        await InstanceRegistry(redis, Keys("health"), ttl_s=30).register(info)
        await redis.aclose()

    asyncio.run(register(instance("decode-a", "decode")))
    asyncio.run(register(instance("decode-b", "decode", draining=True)))
    base = ["status", "--redis-url", redis_url, "--cluster", "health", "--check"]
    assert main([*base, "decode-a"]) == 0 and "decode-a: ready" in capsys.readouterr().out
    assert main([*base, "decode-b"]) == 1 and "draining" in capsys.readouterr().err
    assert main([*base, "decode-c"]) == 1 and "not registered" in capsys.readouterr().err


def make_batches(redis_url: str, cluster: str, finished: int = 0, later: int = 0) -> tuple[str, list[str]]:
    """A batch in progress (3 lines: one done, one failed) with its validation job queued in rq,
    then ``finished`` completed batches, then ``later`` validating ones; the ids of the first and of
    the finished ones (oldest first)."""
    import asyncio

    from pdserve.batchstore.batch_queue import BatchQueue
    from pdserve.batchstore.batches import BatchStore
    from pdserve.scheduler import Keys, RedisSettings

    async def make() -> tuple[str, list[str]]:
        redis = RedisSettings.from_url(redis_url).connect()
        store = BatchStore(redis, Keys(cluster))
        try:
            running = await store.create("file-abc", "/v1/chat/completions", "24h", None)
            assert await store.update(running.id, ("validating",), status="in_progress", total=3)
            assert await store.record(running.id, 0, {"ok": 0}, error=False)
            assert await store.record(running.id, 2, {"bad": 2}, error=True)
            done = []
            for _ in range(finished):
                batch = await store.create("file-abc", "/v1/completions", "1h", None)
                assert await store.update(batch.id, ("validating",), status="completed", total=1)
                done.append(batch.id)
                await asyncio.sleep(0.003)  # distinct creation milliseconds: a defined newest
            for _ in range(later):
                await store.create("file-abc", "/v1/completions", "1h", None)
            return running.id, done
        finally:
            await redis.aclose()

    made = asyncio.run(make())
    queue = BatchQueue(RedisSettings.from_url(redis_url).connect_sync(), Keys(cluster))
    queue.enqueue_validate("batch_waiting")  # no batch worker runs here: it stays queued
    queue.connection.close()
    return made


def test_status_shows_active_and_recent_batches(redis_url, redis_client, capsys) -> None:
    """Text and JSON: the active batch with its counts, the 5 newest final ones, the queue depth."""
    from pdserve.scheduler import Keys

    running, done = make_batches(redis_url, "bstat", finished=7, later=1)
    (late,) = redis_client.zrange(Keys("bstat").owner_batches(""), -1, -1)
    redis_client.srem(Keys("bstat").active_batches, late)  # as if created between the two reads
    base = ["status", "--redis-url", redis_url, "--cluster", "bstat"]
    assert main([*base, "--json"]) == 0
    batches = json.loads(capsys.readouterr().out)["batches"]
    assert batches["queue_depth"] == 1
    (active,) = batches["active"]
    assert active["id"] == running and active["status"] == "in_progress"
    assert active["endpoint"] == "/v1/chat/completions"
    assert active["request_counts"] == {"completed": 1, "failed": 1, "total": 3}
    assert abs(active["created_at"] - time.time()) < 60
    assert [b["id"] for b in batches["recent"]] == done[::-1][:5]  # newest first, five of seven
    assert {b["status"] for b in batches["recent"]} == {"completed"}

    assert main(base) == 0
    text = capsys.readouterr().out
    assert "batches: 1 active, 5 recently final; queue: 1 job(s) waiting" in text, text
    (row,) = [line for line in text.splitlines() if line.startswith(running)]
    assert row.split()[1:4] == ["in_progress", "/v1/chat/completions", "1/1/3"], row
    assert done[-1] in text and done[1] not in text and done[0] not in text


def test_status_finds_the_final_batches_behind_many_active_ones(redis_url, redis_client, capsys) -> None:
    """The newest 50 batches are active: the recent final ones come from further down the index."""
    running, done = make_batches(redis_url, "bdeep", finished=51, later=52)
    assert main(["status", "--redis-url", redis_url, "--cluster", "bdeep", "--json"]) == 0
    batches = json.loads(capsys.readouterr().out)["batches"]
    assert len(batches["active"]) == 53 and running in {b["id"] for b in batches["active"]}
    assert [b["id"] for b in batches["recent"]] == done[::-1][:5]


def test_status_without_batches_or_rq_says_so_quietly(redis_url, redis_client, capsys) -> None:
    """No batch: no batch section. A Redis Cluster URL has no rq queue (None, "n/a"), never an error."""
    from pdserve.status_read import batch_queue
    from pdserve.status_table import render

    assert main(["status", "--redis-url", redis_url, "--cluster", "quiet"]) == 0
    assert capsys.readouterr().out == "cluster quiet: 0 instance(s), 0 router(s)\n"
    assert batch_queue("redis+cluster://127.0.0.1:1,127.0.0.1:2", "c") is None  # connects nothing
    batch = {
        "id": "batch_1",
        "status": "in_progress",
        "endpoint": "/v1/completions",
        "request_counts": {"completed": 2, "failed": 0, "total": 4},
        "created_at": 0,
    }
    status = {
        "cluster": "c",
        "instances": [],
        "routers": [],
        "batches": {"queue_depth": None, "active": [batch], "recent": []},
    }
    assert "queue: n/a" in render(status) and "2/0/4" in render(status)


def test_generate_sampling_flags_come_from_sampling_params(capsys) -> None:
    """Each flagged SamplingParams field is a `generate` flag; a bad value names the flag."""
    from pdserve.cli_commands import sampling_params
    from pdserve.sampling_params import SamplingParams

    parser = build_parser()
    gen = subcommands(parser)["generate"]
    argv = ["--model", "m", "--prompt", "p", "--seed", "3", "--stop", "a", "--stop", "b"]
    args = parser.parse_args(["generate", *argv, "--stop-token-id", "7", "--ignore-eos"])
    assert sampling_params(args, gen) == SamplingParams(
        temperature=0.0, max_tokens=64, seed=3, stop=["a", "b"], stop_token_ids=[7], ignore_eos=True
    )
    bad = (("--top-p", "0"), ("--stop-token-id", "-1"), ("--logprobs", "21"), ("--prompt-logprobs", "21"))
    for flag, value in bad:
        with pytest.raises(SystemExit):
            sampling_params(parser.parse_args(["generate", flag, value]), gen)
        assert f"{flag}: " in capsys.readouterr().err


def test_stack_keeps_the_redis_password_off_argv_the_banner_and_other_users(tmp_path, monkeypatch) -> None:
    """A stack on a password-protected Redis: the children reach it (the URL is in their
    environment), yet no child's command line holds the password (`ps` shows argv to every user);
    the banner and status show it as ***, and the record `pdserve status` reads is private (0600)."""
    import stat

    from pdserve.localredis.embedded import EmbeddedRedis, free_port
    from pdserve.stack import Stack, StackSpec
    from pdserve.stack_banner import banner

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    password = "pw-sentinel-4711"
    server = EmbeddedRedis(password=password)
    assert password not in " ".join(server.command())
    server.start()
    spec = StackSpec(
        model="tiny", redis_url=server.url, port=free_port(), prefill=0, decode=0, mixed=1, engine_kind="echo"
    )
    stack = Stack(spec)
    try:
        stack.start()
        assert stack.batch_workers, "the default stack runs a batch worker"
        for name, proc in stack.workers + stack.routers + stack.batch_workers:
            cmdline = (Path(f"/proc/{proc.pid}/cmdline")).read_bytes()
            assert password.encode() not in cmdline, (name, cmdline)
        stack.wait_ready()  # the children did connect: the password reached them
        stack.record()
        assert stat.S_IMODE(record_path().stat().st_mode) == 0o600
        assert running_stack()["redis_url"] == server.url  # status can still connect
        shown = banner(stack, "tiny", 1.0)
        assert password not in shown and "redis://:***@" in shown
    finally:
        stack.stop()
        server.close()
    assert not record_path().exists()


@pytest.mark.parametrize("source", ["PDSERVE_API_KEY", "router option"])
def test_a_stack_with_an_api_key_becomes_ready_and_keeps_the_key_to_itself(
    source, redis_url, tmp_path, monkeypatch, capsys, caplog
) -> None:
    """Routers with an API key (`PDSERVE_API_KEY`, as `up` users set it, or a router option): `up`'s
    readiness checks send it (/v1/instances wants it), so the stack comes up rather than get 401 for
    its whole ready timeout and stop. The key is on no child's command line (`ps`), and nothing `up`
    prints or logs holds it; the routers do require it."""
    import secrets

    import httpx

    from pdserve.localredis.embedded import free_port
    from pdserve.stack import Stack, StackSpec
    from pdserve.stack_banner import banner

    key = f"key-sentinel-{secrets.token_hex(4)}"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    options = {}
    if source == "PDSERVE_API_KEY":
        monkeypatch.setenv("PDSERVE_API_KEY", key)
    else:
        monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
        options = {"api_key": f"another-one,{key}"}
    caplog.set_level(logging.DEBUG, logger="pdserve.stack")
    spec = StackSpec(
        model="tiny",
        redis_url=redis_url,
        cluster=f"key{secrets.token_hex(3)}",
        port=free_port(),
        prefill=0,
        decode=0,
        mixed=1,
        batch_workers=0,
        engine_kind="echo",
        router_options=options,
        ready_timeout_s=30,
    )
    stack = Stack(spec)
    try:
        stack.start()
        for name, proc in stack.workers + stack.routers:
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            assert key.encode() not in cmdline, (name, cmdline)
        stack.wait_ready()
        url = stack.urls[0] + "/v1/models"
        assert httpx.get(url, timeout=5).status_code == 401
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code == 200
        print(banner(stack, "tiny", 1.0))
    finally:
        stack.stop()
    out = capsys.readouterr()
    assert key not in out.out + out.err and key not in caplog.text


def up_process(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    """`pdserve up` on the echo engine (a mixed worker, a router, a batch worker, embedded Redis), as
    a user starts it, once it says it is up; its output goes to the file returned."""
    from pdserve.localredis.embedded import free_port

    out = tmp_path / "up.log"
    argv = ["up", "--engine", "echo", "--model", "tiny", "--prefill", "0", "--decode", "0", "--mixed", "1"]
    argv += ["--port", str(free_port()), "--num-blocks", "256", "--threads", "1", *flags]
    with out.open("wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache")},
        )
    deadline = time.monotonic() + 120
    while b"Ctrl-C stops everything" not in out.read_bytes():
        assert up.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.1)
    return up, out


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc: children, their children, ...)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in "ZX":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie nobody reaped yet has ended)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in "ZX":
            running.add(pid)
    return running


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_up_killed_takes_its_children_with_it(tmp_path) -> None:
    """SIGKILL `pdserve up` (no code of it runs to stop them): its Redis, worker, router and batch
    worker, each in a session of its own, are gone within seconds rather than left running."""
    import signal

    up, _ = up_process(tmp_path)
    children = descendants(up.pid)
    try:
        assert len(children) >= 4, children  # redis-server, worker, router, batch worker
        up.kill()
        up.wait(10)
        deadline = time.monotonic() + 10
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in alive(children)}
        assert not left, f"still running after up was killed: {left}"
    finally:
        for pid in alive(children):
            os.kill(pid, signal.SIGKILL)
        if up.poll() is None:
            up.kill()


def test_up_stops_everything_within_10_s_of_sigterm_with_a_batch_running(tmp_path) -> None:
    """SIGTERM to `pdserve up` while its batch worker runs a batch: up exits 0 within 10 s, and so
    has every process it started (its batch worker once took a minute: rq's pubsub thread)."""
    import signal

    import httpx

    up, out = up_process(tmp_path)
    children = descendants(up.pid)
    try:
        url = re.search(r"OpenAI API:\s+(\S+)/v1", out.read_text()).group(1)  # type: ignore[union-attr]
        lines = [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions"}
            | {"body": {"model": "tiny", "prompt": f"line {i}", "max_tokens": 64}}
            for i in range(2000)
        ]
        data = "\n".join(json.dumps(line) for line in lines).encode()
        file = httpx.post(url + "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
        body = {"input_file_id": file.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        batch = httpx.post(url + "/v1/batches", json=body).json()
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 100:
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.1)
        t0 = time.monotonic()
        up.send_signal(signal.SIGTERM)
        code = up.wait(60)
        took = time.monotonic() - t0
        text = out.read_text()
        assert code == 0 and "stopped." in text, text[-3000:]
        assert took < 10, f"up took {took:.1f} s to stop:\n{text[-3000:]}"
        assert "did not stop" not in text and not alive(children)
    finally:
        for pid in alive(children):
            os.kill(pid, signal.SIGKILL)
        if up.poll() is None:
            up.kill()


def test_status_watch_shows_the_redis_url_without_its_password() -> None:
    from pdserve.scheduler.redis_client import redact_url
    from pdserve.status_watch import unreachable

    shown = unreachable("redis://:pw-sentinel@h:1/0", ConnectionError("refused"))
    assert "pw-sentinel" not in shown and "redis://:***@h:1/0" in shown
    assert redact_url("redis://:s%40cret@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("rediss://user:pw@h:1/0") == "rediss://user:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_worker_metrics_listen_on_loopback_unless_told(tmp_path, monkeypatch) -> None:
    from pdserve.flags import from_args
    from pdserve.localredis.embedded import free_port
    from pdserve.worker.metrics import WorkerMetrics
    from pdserve.worker.settings import WorkerSettings

    def settings(*argv: str) -> WorkerSettings:
        args = build_parser().parse_args(["worker", "--model", str(tmp_path), *argv])
        return from_args(WorkerSettings, args)

    monkeypatch.delenv("PDSERVE_METRICS_HOST", raising=False)
    default = settings()
    assert (
        default.metrics_host == "127.0.0.1"
        and "redis_url" not in repr(default)
        and "redis://" not in repr(default)
    )
    metrics = WorkerMetrics("mixed", "m0")
    metrics.serve(free_port(), default.metrics_host)
    try:
        assert metrics._server.server_address[0] == "127.0.0.1"
    finally:
        metrics.close()
    assert settings("--metrics-host", "0.0.0.0").metrics_host == "0.0.0.0"
    monkeypatch.setenv("PDSERVE_METRICS_HOST", "10.1.2.3")
    assert settings().metrics_host == "10.1.2.3"


def test_up_from_a_folder_holding_pdserve_with_another_python_on_path(tiny_model_dir, tmp_path) -> None:
    """A new user's `pdserve up`: run from a folder that holds a `pdserve/` folder (which must not
    shadow the installed package in the children), with the venv not activated and PATH's `python`
    the base interpreter the venv was made from (pyenv, Docker `python` images): the stack comes up,
    and the banner's Python example, pasted into that shell, works."""
    import signal
    import time

    from pdserve.localredis.embedded import free_port

    work, fake_bin = tmp_path / "work", tmp_path / "bin"
    (work / "pdserve").mkdir(parents=True)
    (work / "pdserve" / "cli.py").write_text("raise SystemExit('the bogus pdserve/cli.py ran')\n")
    fake_bin.mkdir()
    (fake_bin / "python").symlink_to(Path(sys.executable).resolve())  # no openai installed there
    venv_bin = Path(sys.executable).parent
    path = [str(fake_bin)] + [p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != venv_bin]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "VIRTUAL_ENV"))}
    env |= {"PATH": os.pathsep.join(path), "PDSERVE_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["up", "--engine", "echo", "--prefill", "0", "--decode", "0", "--mixed", "1"]
    argv += [
        "--port",
        str(free_port()),
        "--model",
        str(tiny_model_dir),
        "--num-blocks",
        "256",
        "--threads",
        "1",
    ]
    up = subprocess.Popen(
        [str(venv_bin / "pdserve"), *argv],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, deadline = "", time.monotonic() + 120
        while "Ctrl-C stops everything" not in out:
            line = up.stdout.readline()
            assert line and time.monotonic() < deadline, f"pdserve up did not come up:\n{out}"
            out += line
        example = re.search(r"^  (\S+ -c 'from openai import OpenAI\n.*?\)')$", out, re.S | re.M)
        assert example, out
        reply = subprocess.run(
            ["bash", "-c", example.group(1)], cwd=work, env=env, capture_output=True, text=True, timeout=60
        )
        assert reply.returncode == 0 and reply.stdout.strip(), (example.group(1), reply.stderr)
    finally:
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=90)
    assert up.returncode == 0 and "stopped." in rest, rest


def test_up_says_what_it_waits_for(tmp_path, capsys) -> None:
    """While the stack starts (a first start compiles kernels for a minute) `up` is not silent."""
    from pdserve.localredis.embedded import free_port
    from pdserve.stack import Stack, StackSpec

    stack = Stack(StackSpec(port=free_port(), mixed=1, decode=0, ready_timeout_s=3.0))
    with pytest.raises(TimeoutError):
        stack.wait_ready(progress_s=0.5)  # nothing listens on the router's port
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2, lines
    assert all(
        re.fullmatch(rf"starting \(\d+ s\): waiting for {stack.urls[0]} to answer \.\.\.", x) for x in lines
    )


def test_the_kernel_compile_says_it_takes_a_minute(monkeypatch, caplog) -> None:
    """A worker's first start on a CPU compiles the numba kernels (about a minute): it says so, and
    how long it took, rather than sit silent while requests get 503."""
    pytest.importorskip("numba")
    from pdserve.engine.cpu import attention

    monkeypatch.setattr(attention, "_compiled", None)  # as in a fresh worker process
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        attention._compile(1)
    said = [r.getMessage() for r in caplog.records if r.name == attention.__name__]
    assert said[0].startswith("compiling the attention kernels for this CPU (first start: ~1 min"), said
    assert re.fullmatch(r"attention kernels ready in \d+\.\d s", said[-1]), said


def test_up_on_gpus_places_workers_in_turn_and_splits_each_card(monkeypatch) -> None:
    """``pdserve up --device cuda --gpus 0,1``: workers go to the cards in turn, each card's memory
    share split between the workers on it (the host's GPU check answered "cuda" here: no GPU)."""
    from pdserve.engine import platform
    from pdserve.engine.config import EngineConfig
    from pdserve.errors import ConfigError
    from pdserve.stack import Stack, StackSpec

    monkeypatch.setattr(platform, "resolve_device", lambda device: "cuda")
    engine = EngineConfig(device="cuda", gpu_memory_utilization=0.9)
    stack = Stack(StackSpec(model="tiny", prefill=2, decode=1, gpus="0,1", engine=engine))
    assert stack._gpu_placement(3) == [(0, 0.45), (1, 0.9), (0, 0.45)]
    assert (
        stack.device
        == "cuda (PyTorch; GPU 0: 2 worker(s), 45% of it each, GPU 1: 1 worker(s), 90% of it each)"
    )
    one = Stack(StackSpec(model="tiny", engine=dataclasses.replace(engine, gpu=3)))
    assert one._gpu_placement(2) == [(3, 0.45), (3, 0.45)]
    monkeypatch.setattr(platform, "resolve_device", lambda device: "cpu")
    assert Stack(StackSpec(model="tiny", engine=engine))._gpu_placement(2) is None
    for bad in ("0,x", "-1", ""):
        with pytest.raises(ConfigError, match="--gpus must be GPU indices"):
            StackSpec(model="tiny", gpus=bad)
