"""What installing pdserve brings, and one supported-Python floor stated alike everywhere a user or a
tool reads it.

The floor is 3.11 (3.10 reached its end of life in October 2026, and ``asyncio.TimeoutError`` is
not ``TimeoutError`` there: code that suppresses the builtin one misses asyncio's). ``make up`` on a
host without an NVIDIA driver installs no torch and no CUDA wheel: the CPU engine never loads them,
and PyPI's torch brings several GB of them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pdserve.engine.platform import nvidia_driver_present

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.executable).parent.parent


def floor() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=(\d+)\.(\d+)", spec.strip())
    assert m, f"requires-python should be a plain floor, got {spec!r}"
    return int(m[1]), int(m[2])


def test_the_python_floor_is_the_same_everywhere() -> None:
    major, minor = floor()
    assert (major, minor) >= (3, 11)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert config["ruff"]["target-version"] == f"py{major}{minor}"
    assert config["mypy"]["python_version"] == f"{major}.{minor}"
    for doc in ("README.md", "Makefile"):
        stated = set(re.findall(r"Python >= (\d+\.\d+)", (ROOT / doc).read_text()))
        assert stated == {f"{major}.{minor}"}, (doc, stated)
    image = re.search(r"^FROM python:(\d+)\.(\d+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert image and (int(image[1]), int(image[2])) >= (major, minor)


def test_this_interpreter_is_supported() -> None:
    assert sys.version_info[:2] >= floor()


def cuda_wheels(names: list[str]) -> list[str]:
    """The CUDA side of PyTorch among distribution names: torch itself, Triton, nvidia-*, cuda-*."""
    norm = (re.sub(r"[-_.]+", "-", n).lower() for n in names)
    return sorted(n for n in norm if n in ("torch", "triton") or n.startswith(("nvidia-", "cuda-")))


def test_make_up_without_a_driver_installed_no_cuda_wheel() -> None:
    """What `make up`'s install step resolved, as pip reported it (the Makefile keeps the report in
    the venv; .ci/run's fresh clone always has one): pdserve and its dependencies, no torch."""
    if nvidia_driver_present():
        pytest.skip("this host has an NVIDIA driver: make up installs the cuda extra here")
    report = VENV / "up-install.json"
    if not report.is_file():
        assert not os.environ.get("PDSERVE_REQUIRE_UP_REPORT"), f"no {report}: was this venv made by make?"
        pytest.skip(f"{VENV} was not made by this Makefile's make up (no up-install.json)")
    names = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert names, "pip's report of make up's install lists nothing"
    assert cuda_wheels(names) == [], f"make up installed {cuda_wheels(names)} on a host without a driver"


def test_make_picks_the_cuda_extra_only_where_a_driver_is(tmp_path: Path) -> None:
    """`make -n` prints what make up and make test would run in a new venv: the cuda extra (PyPI's
    torch) for make up only with CUDA=yes (set by the Makefile where a driver is found), PyTorch's
    CPU build for make test without."""

    def recipe(target: str, *args: str) -> str:
        out = subprocess.run(
            ["make", "-n", target, f"VENV={tmp_path / 'venv'}", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout

    installs = [line for line in recipe("up", "CUDA=").splitlines() if "pip install" in line]
    assert installs[-1].endswith("-e '.[test,mooncake,bench]'") and "torch" not in "".join(installs)
    assert "-e '.[test,mooncake,bench,cuda]'" in recipe("up", "CUDA=yes")
    test = recipe("test", "CUDA=")
    assert "--no-deps" in test and "+cpu" in test and "-e '.[test,mooncake,bench,cuda]'" in test
    assert "+cpu" not in recipe("test", "CUDA=yes")
    detected = recipe("up")  # this host's own answer agrees with pdserve's --device auto
    assert ("cuda]'" in detected) == nvidia_driver_present()
