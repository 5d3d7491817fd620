"""Writing a model folder: every writer (``model init``, a GGUF import, a copied folder) builds it in
a temporary folder beside the target and renames it into place, so a reader (a worker starting,
another import) never finds a half-written one."""

from __future__ import annotations

import contextlib
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdserve.errors import ConfigError


def check_target(target: str | Path, overwrite: bool = False) -> Path:
    """``target`` as an absolute path, if a model folder may be written there: not a file, and
    empty unless ``overwrite`` (a writer with long work ahead calls this first)."""
    target = Path(target).absolute()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"model path {target} exists and is not a folder")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ConfigError(f"model folder {target} is not empty; replace it with --overwrite (overwrite=True)")
    return target


@contextlib.contextmanager
def written_atomically(target: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder to fill; on success it replaces ``target`` (an old folder is
    moved aside, then deleted), on failure it is removed. A non-empty ``target`` needs ``overwrite``."""
    target = check_target(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if target.is_dir():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
        tmp.rename(target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
