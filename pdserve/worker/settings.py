"""A worker instance's settings: one validated dataclass, light to import (no Paddle), so the CLI
reads its defaults without loading the engine."""

from __future__ import annotations

import dataclasses
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.errors import ConfigError
from pdserve.scheduler.keys import DEFAULT_CLUSTER
from pdserve.scheduler.registry import DEFAULT_TTL_S

if TYPE_CHECKING:
    from pdserve.worker.engine import EngineConfig

ROLES = ("prefill", "decode", "mixed")


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    role: str
    model_dir: Path
    redis_url: str
    engine: EngineConfig
    instance_id: str = ""
    served_model_name: str = ""
    cluster: str = DEFAULT_CLUSTER
    host: str = dataclasses.field(default_factory=socket.gethostname)
    ttl_s: float = DEFAULT_TTL_S
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.instance_id:
            object.__setattr__(self, "instance_id", f"{self.role}-{uuid.uuid4().hex[:8]}")
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", Path(self.model_dir).resolve().name)


def default(name: str):
    """The declared default of one WorkerSettings field (for flags)."""
    return WorkerSettings.__dataclass_fields__[name].default
