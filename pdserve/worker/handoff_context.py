"""What both sides of every splitwise hand-off on one instance share: a module of its own, so the
prefill and decode machines (prefill_handoff.py, decode_lease.py) and the table of them
(splitwise.py) all take it without importing each other."""

from __future__ import annotations

import asyncio
import dataclasses

from pdserve.scheduler import IntegrityInfo
from pdserve.worker.clock import Clock
from pdserve.worker.engine_client import EngineClient
from pdserve.worker.fault_hooks import FaultHooks
from pdserve.worker.kv_writers import Transports
from pdserve.worker.messenger import Messenger
from pdserve.worker.metrics import WorkerMetrics

MAX_TRANSFERS = 4
"""KV writes an instance runs at once, each on a thread of its own; more wait for a slot (a
machine's copy bandwidth is shared: more at once only makes each later)."""


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
    kv_checksum: bool = True
    """Digest every block written (prefill) and check the digests received (decode): --kv-checksum."""
    integrity: IntegrityInfo = dataclasses.field(default_factory=IntegrityInfo)
    """What this instance's checks of received KV found (its registration's ``integrity``)."""
    faults: FaultHooks = dataclasses.field(default_factory=FaultHooks)
    transfer_slots: asyncio.Semaphore = dataclasses.field(
        default_factory=lambda: asyncio.Semaphore(MAX_TRANSFERS)
    )
