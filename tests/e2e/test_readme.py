"""Every shell command and Python snippet in the README and in docs/ works when pasted into a fresh shell.

As a new user would run them after ``make up``: from a checkout folder holding the project's
``.venv`` (a link to the venv running these tests), with a fresh ``HOME`` (so ``~/.cache/pdserve``
is new), no ``PDSERVE_*`` or ``MKL_*`` variables, the venv not on ``PATH``, and the documented ports
(8000, 8001, 6379) replaced by free ones so the test can run next to anything else. A block is found
by a line it holds, in whichever file shows it (README.md or a page of docs/): the README keeps the
first request, the pieces, two hosts and the GPU; docs/ the rest, some of them shown in both.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.engine.cpu.host_cpu import usable_cores
from pdserve.localredis.embedded import free_port
from pdserve.stack_spec import StackSpec

ROOT = Path(__file__).resolve().parents[2]
# The README and every page of docs/, by path: every ```bash and ```python block in them is run below
# or listed in NOT_RUN.
DOCS = {
    p.relative_to(ROOT).as_posix(): p.read_text()
    for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]
}
VENV = Path(sys.executable).parent.parent

# Every ```bash block is one of these, recognised by a line it contains.
AFTER_UP, PIECES, OFFLINE = "curl http://127.0.0.1:8000", "pdserve redis --port", "pdserve generate"
SENTINEL = "pdserve redis --sentinel"
# Every ```python block is one of these, each run below.
PYTHON = ("Once upon a time", "tool_choice=", "client.batches.create", "from pdserve import LLM")
NOT_RUN = {
    "make test": "the two commands: this test runs what `make up` runs, and `make test` runs this test",
    "benchmarks/engine_bench.py": "a benchmark of about 15 minutes, run by hand",
    "--device cuda": "needs an NVIDIA GPU: benchmarks/gpu_check.sh runs a GPU stack there",
    "# host B": "needs two hosts: tests/e2e/test_multihost.py runs these commands in two network namespaces",
}


def blocks(lang: str, where: str | None = None) -> list[str]:
    """The ```lang blocks of one file (``where``, e.g. "README.md"), or of the README and all of docs/."""
    texts = [DOCS[where]] if where else list(DOCS.values())
    return [b for text in texts for b in re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)]


def block(lang: str, marker: str) -> str:
    """The block holding ``marker``; one shown in several files must be the same in each."""
    found = {b for b in blocks(lang) if marker in b}
    assert len(found) == 1, f"{len(found)} different ```{lang} blocks hold {marker!r}"
    (one,) = found
    return one


@pytest.fixture
def shell(tmp_path: Path, smollm2_dir: Path):
    """A fresh shell's environment in a fresh checkout folder, and the documented ports remapped. The
    fresh HOME's model cache holds the real model this test run already fetched (fetched once a run)."""
    assert (VENV / "bin" / "pdserve").is_file(), f"tests must run from the project's venv, not {VENV}"
    work, home = tmp_path / "checkout", tmp_path / "home"
    work.mkdir()
    (home / ".cache" / "pdserve" / "models").mkdir(parents=True)
    (home / ".cache" / "pdserve" / "models" / smollm2_dir.name).symlink_to(smollm2_dir)
    (work / ".venv").symlink_to(VENV)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != VENV / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "MKL_", "VIRTUAL_ENV"))}
    env |= {"HOME": str(home), "PATH": path}
    ports = {"8000": free_port(), "8001": free_port(), "6379": free_port()}

    def remap(text: str) -> str:
        for old, new in ports.items():
            text = text.replace(old, str(new))
        return text

    def run(script: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-e", "-c", remap(script)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def python(code: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [".venv/bin/python", "-c", remap(code)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    return work, env, ports, remap, run, python


def test_every_block_is_covered() -> None:
    """A new block in the README or docs/ must be added here: run by the tests below, or excluded
    with a reason."""
    for where in DOCS:
        for b in blocks("bash", where):
            kinds = [m for m in (AFTER_UP, PIECES, OFFLINE, SENTINEL, *NOT_RUN) if m in b]
            assert len(kinds) == 1, f"{where}: block not covered by tests/e2e/test_readme.py:\n{b}"
        for b in blocks("python", where):  # the client, tools, batches and the offline API
            kinds = [m for m in PYTHON if m in b]
            assert len(kinds) == 1, f"{where}: block not covered by tests/e2e/test_readme.py:\n{b}"
    for marker in (AFTER_UP, PIECES, OFFLINE, SENTINEL):  # each shown once, or the same wherever shown
        block("bash", marker)
    for marker in PYTHON:
        block("python", marker)
    # the README's own: the first request and the client after `make up`, the pieces, two hosts, a GPU
    readme = blocks("bash", "README.md") + blocks("python", "README.md")
    for marker in ("make test", AFTER_UP, PYTHON[0], PIECES, "# host B", "--device cuda"):
        assert any(marker in b for b in readme), f"README.md lost its block holding {marker!r}"


def documented_key_patterns() -> list[re.Pattern]:
    """The key shapes of docs/design.md's key table, as regexes (``<...>`` is one component)."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("## 3. Redis key schema") : text.index("## 4.")]
    shapes = re.findall(r"^\| `(pdserve:[^`]+)`", table, flags=re.M)
    assert len(shapes) >= 7, shapes
    return [
        re.compile(re.sub(r"<[^>]+>", "[^:{}]+", re.escape(k).replace(r"\<", "<").replace(r"\>", ">")))
        for k in shapes
    ]


def assert_keys_are_documented(record: dict) -> None:
    """Every key on the running stack's Redis has a shape that docs/design.md describes."""
    import redis

    client = redis.Redis.from_url(record["redis_url"], decode_responses=True)
    try:
        keys = sorted(client.scan_iter("*"))
    finally:
        client.close()
    patterns = documented_key_patterns()
    assert len(keys) >= 7  # 2 instances, their index, 1 router, its index, 2 inboxes, the outbox
    design = (ROOT / "docs" / "design.md").read_text()
    for key in keys:
        if key.startswith("rq:"):  # the batch queue's keys are rq's own, documented as one row
            assert "| `rq:queue:pdserve-batch-<c>`" in design
            continue
        assert any(p.fullmatch(key) for p in patterns), f"{key} is not described in docs/design.md"


def wait_for(url: str, timeout_s: float, ok=lambda r: r.status_code == 200) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.get(url, timeout=2)
            if ok(r):
                return r
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready after {timeout_s} s"
        time.sleep(0.3)


def stop_group(pgid: int, timeout_s: float = 60) -> None:
    """SIGTERM a process group (workers drain), then wait until every member is gone."""
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
    pytest.fail(f"process group {pgid} did not stop within {timeout_s} s of SIGTERM")


def test_readme_commands_work_in_a_fresh_shell(shell) -> None:
    work, env, ports, remap, run, python = shell
    make_up = re.search(r"^up: .*\n\t\$\(BIN\)/pdserve (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert make_up, "Makefile's up target changed shape"
    t0 = time.monotonic()  # a fresh HOME (its model cache holds the fetched real model)
    up = subprocess.Popen(
        [".venv/bin/pdserve", *make_up.group(1).split(), "--port", str(ports["8000"])],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        banner = ""
        while "Ctrl-C stops everything" not in banner:
            line = up.stdout.readline()
            assert line, f"pdserve up exited early:\n{banner}"
            banner += line
            assert time.monotonic() - t0 < 60, banner
        assert "(also" not in banner  # one router: no list of further URLs
        assert "bin/pdserve status" in banner  # the venv is not on PATH in a fresh shell
        assert f"curl http://127.0.0.1:{ports['8000']}/v1/chat/completions" in banner
        assert "OpenAI(base_url=" in banner

        after_up = run(block("bash", AFTER_UP))
        assert after_up.returncode == 0, after_up.stderr
        assert '"content":"The capital of France is Paris."' in after_up.stdout, after_up.stdout
        assert time.monotonic() - t0 < 60  # from `make up` to the first chat completion
        # `pdserve status` found the stack's Redis by itself: it lists the stack's workers and router
        # (the layout `up` picks for this host: one mixed instance below 5 usable cores, else a pair)
        workers = StackSpec().with_layout(usable_cores(), "cpu").n_workers
        assert f"cluster default: {workers} instance(s), 1 router(s), 1 batch worker(s)" in after_up.stdout, (
            after_up.stdout
        )
        assert "usable core" in banner  # it says why it picked that layout

        batch = python(block("python", "client.batches.create"))
        assert batch.returncode == 0, batch.stderr
        assert batch.stdout.startswith(
            "completed BatchRequestCounts(completed=2, failed=0, total=2)\nq0 The capital of France is Paris."
        ), batch.stdout

        (record,) = (Path(env["HOME"]) / ".cache/pdserve").glob("up-*.json")  # one per stack
        assert_keys_are_documented(json.loads(record.read_text()))

        client = python(block("python", "Once upon a time"))
        assert client.returncode == 0, client.stderr
        assert "CompletionUsage" in client.stdout
        tools = python(block("python", "tool_choice="))
        assert tools.returncode == 0, tools.stderr
        assert (
            tools.stdout.startswith('tool_calls Function(arguments=\'{"city":')
            and "get_weather" in tools.stdout
        )
    finally:
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=90)
    assert up.returncode == 0 and "stopped." in rest
    assert not list((Path(env["HOME"]) / ".cache" / "pdserve").glob("up-*.json"))

    # Running the pieces by hand: the block leaves Redis, two workers and two routers running.
    log = work / "pieces.log"
    with log.open("w") as out:  # not a pipe: the background jobs outlive the shell
        pieces = subprocess.Popen(
            ["bash", "-e", "-c", remap(block("bash", PIECES))],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the shell and its background jobs: one process group
        )
    try:
        assert pieces.wait(timeout=180) == 0, log.read_text()
        for port in (ports["8000"], ports["8001"]):
            wait_for(f"http://127.0.0.1:{port}/ready", 120)
        wait_for(
            f"http://127.0.0.1:{ports['8000']}/v1/instances",
            60,
            lambda r: {i["role"] for i in r.json()["instances"]} == {"prefill", "decode"},
        )
        for port in (ports["8000"], ports["8001"]):
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True},
                timeout=60,
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    finally:
        stop_group(pieces.pid)
    assert (work / "models" / "tiny" / "config.json").is_file()

    offline = run(block("bash", OFFLINE), timeout=300)
    assert offline.returncode == 0, offline.stderr
    assert (work / "models" / "small" / "model.safetensors.index.json").is_file()
    assert '"usage"' in offline.stdout  # the --json line
    assert offline.stdout.startswith("The capital of France is Paris.\n"), offline.stdout

    api = python(block("python", "from pdserve import LLM"))
    assert api.returncode == 0, api.stderr
    # two generations (text, finish reason, usage) and one chat reply; split on "\n" only: a random
    # model's text may hold characters str.splitlines() also breaks at (\x1e, \x1c, \u2028, ...)
    assert api.stdout.count("'prompt_tokens':") == 2, api.stdout
    assert len(api.stdout.rstrip("\n").split("\n")) >= 3, api.stdout


def test_the_high_availability_commands_serve_through_sentinel(shell) -> None:
    """docs/operations.md's Sentinel block, each command in a fresh shell of its own: `pdserve redis
    --sentinel` in the background, then `pdserve up` on its redis+sentinel:// URL; a chat completion
    goes through, and Ctrl-C stops each (every Redis process with the first)."""
    work, env, _, remap, _, _ = shell
    activate, redis_line, up_line = block("bash", SENTINEL).strip().splitlines()
    first = free_port(count=5)
    router_port = free_port()

    def start(line: str) -> subprocess.Popen:
        command = line.split("#")[0].strip().removesuffix("&")
        for i in range(5):  # primary, replica, 3 Sentinels: consecutive ports from --port
            command = command.replace(str(26000 + i), str(first + i))
        return subprocess.Popen(
            ["bash", "-e", "-c", f"{activate}\nexec {remap(command)}"],
            cwd=work,
            env={**env, "PDSERVE_PORT": str(router_port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_for_line(proc: subprocess.Popen, text: str) -> str:
        out = ""
        while text not in out:
            line = proc.stdout.readline()
            assert line, f"exited early:\n{out}"
            out += line
        return out

    redis = start(redis_line)
    try:
        assert "redis+sentinel://127.0.0.1:" in wait_for_line(redis, "Ctrl-C stops every process")
        up = start(up_line)
        try:
            wait_for_line(up, "Ctrl-C stops everything")
            body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            r = httpx.post(f"http://127.0.0.1:{router_port}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        finally:
            up.send_signal(signal.SIGINT)
            up.communicate(timeout=90)
        assert up.returncode == 0
    finally:
        redis.send_signal(signal.SIGINT)
        redis.communicate(timeout=60)
    assert redis.returncode == 0
    for port in range(first, first + 5):  # every Redis process is gone
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
