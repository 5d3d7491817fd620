"""One supported-Python floor, stated alike everywhere a user or a tool reads it.

The floor is 3.11 (3.10 reached its end of life in October 2026, and ``asyncio.TimeoutError`` is
not ``TimeoutError`` there: code that suppresses the builtin one misses asyncio's)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
