"""The example scripts run as documented (ONESHOT=1: start, answer one request, stop what they
started) and leave none of their processes behind. two-hosts.sh runs in tests/e2e/test_multihost.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pdserve.localredis.embedded import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def run_example(name: str, tmp_path: Path, **env: str) -> str:
    env = {**os.environ, "ONESHOT": "1", "PORT": str(free_port()), "MODEL": str(tmp_path / "tiny"), **env}
    out = subprocess.run(
        ["bash", str(ROOT / "examples" / name)],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    left = subprocess.run(
        ["pgrep", "-f", f"--port {env['PORT']}"], capture_output=True, text=True, check=False
    )
    assert left.stdout == "", f"{name} left processes behind: {left.stdout}"
    return out.stdout


@pytest.mark.parametrize("name", ["splitwise.sh", "mixed.sh"])
def test_single_host_examples_serve_and_stop(name, tmp_path) -> None:
    out = run_example(name, tmp_path, REDIS_PORT=str(free_port()))
    assert '"finish_reason":"length"' in out and '"completion_tokens":8' in out


def test_the_existing_redis_example_uses_the_url_it_is_given(tmp_path) -> None:
    server = EmbeddedRedis(workdir=tmp_path / "redis", password="an existing one")
    (tmp_path / "redis").mkdir()
    server.start()
    try:
        out = run_example("existing-redis.sh", tmp_path, REDIS_URL=server.url, CLUSTER="from-example")
    finally:
        server.close()
    assert '"finish_reason":"length"' in out


def test_every_example_parses_and_says_how_to_run_it() -> None:
    for script in sorted((ROOT / "examples").glob("*.sh")):
        assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0, script
        if script.name != "lib.sh":
            assert os.access(script, os.X_OK) and f"examples/{script.name}" in script.read_text(), script
