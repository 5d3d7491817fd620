"""Where a running ``pdserve up`` says how to reach it: ``~/.cache/pdserve/up-<pid>.json`` (mode
0600: it may hold the Redis password), which ``pdserve status`` and ``pdserve role`` read when no
Redis URL is given. One file per stack, removed when it stops; a record whose process is gone is
ignored."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pdserve.engine.models.model_store import cache_dir


def record_path(pid: int | None = None) -> Path:
    """Where the ``pdserve up`` of process ``pid`` (default: this one) says how to reach it, so
    ``pdserve status`` finds its Redis: one file per stack, so a second stack overwrites nothing."""
    return cache_dir() / f"up-{os.getpid() if pid is None else pid}.json"


def running_stack() -> dict | None:
    """The record of a ``pdserve up`` that is still running on this machine (the newest), else None."""
    paths = sorted(cache_dir().glob("up-*.json"), key=_mtime, reverse=True)
    for path in paths:
        try:
            record = json.loads(path.read_text())
            os.kill(int(record["pid"]), 0)  # signal 0: only asks whether the process exists
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return record
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only (0600 from the start: it may hold the
    Redis password), replacing the file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
