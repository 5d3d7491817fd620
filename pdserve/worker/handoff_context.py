"""What both sides of every splitwise hand-off on one instance share: a module of its own, so the
prefill and decode machines (prefill_handoff.py, decode_lease.py) and the table of them
(splitwise.py) all take it without importing each other."""

from __future__ import annotations

import dataclasses

from pdserve.worker.clock import Clock
from pdserve.worker.engine_client import EngineClient
from pdserve.worker.kv_writers import Transports
from pdserve.worker.messenger import Messenger
from pdserve.worker.metrics import WorkerMetrics


@dataclasses.dataclass
class Context:
    """What both sides of every hand-off on this instance share."""

    instance_id: str
    engine: EngineClient
    messenger: Messenger
    clock: Clock
    transports: Transports
    metrics: WorkerMetrics | None = None
    incarnation: str | None = None  # this start's (TransferInfo.incarnation): named in every reserve reply
