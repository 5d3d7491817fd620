"""``pdserve up --autoscale --max-workers N``: the planner's desired counts made worker processes.

The planner (a child of ``up``, ``pdserve plan --apply``) switches roles itself; a change of the
instance count it can only ask for (a decision whose action is ``scale``, its ``desired`` counts
per role). This reads the newest decision from Redis every few seconds and, for a new ``scale``
one, starts a worker of a role that has fewer instances than desired (within ``--max-workers``),
or stops (drains) one of a role that has more. Roles are read from the instances' registrations,
as switches change them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import subprocess
import time
import uuid
from typing import Protocol

from pdserve.errors import ControlPlaneError
from pdserve.planner.loop import last_decision
from pdserve.scheduler import InstanceInfo, Keys, decode_as
from pdserve.scheduler.redis_client import RedisSettings
from pdserve.scheduler.redis_server import redis_errors
from pdserve.stack_spec import StackSpec
from pdserve.worker.settings import WorkerSettings


class ScaledStack(Protocol):
    """What scaling needs of a running ``pdserve up`` (``stack.Stack``)."""

    spec: StackSpec
    redis_url: str
    workers: list[tuple[str, subprocess.Popen]]
    instance_of: dict[str, str]
    worker_base: WorkerSettings | None

    def start_worker(self, name: str, worker: WorkerSettings) -> None: ...
    def retire_worker(self, name: str) -> None: ...


log = logging.getLogger(__name__)


class WorkerScaler:
    def __init__(self, stack: ScaledStack, every_s: float = 2.0) -> None:
        self.stack, self.every_s = stack, every_s
        self.keys = Keys(stack.spec.cluster)
        self.client = RedisSettings.from_url(stack.redis_url).connect_sync()
        self._seen: bytes | str | None = None  # the decision acted on last
        self._next = 0.0
        self._names = itertools.count()

    def tick(self) -> None:
        """Act on the newest decision if it is a new ``scale`` one (every ``every_s`` at most)."""
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.every_s
        try:
            with redis_errors("reading the planner's decisions"):
                entries = self.client.xrevrange(self.keys.plan, count=1)
                if not entries or entries[0][0] == self._seen:
                    return
                entry_id, fields = entries[0]
                self._seen = entry_id
                decision = last_decision(fields)
                if decision["action"] == "scale":
                    self._scale(decision["desired"], self._roles())
        except ControlPlaneError as e:
            log.warning("autoscaling: %s", e)

    def _roles(self) -> dict[str, str]:
        """Worker name -> the role its instance registers now (workers not registered left out)."""
        names = [name for name, _ in self.stack.workers]
        ids = [self.stack.instance_of[name] for name in names]
        values = self.client.mget([self.keys.instance(i) for i in ids]) if ids else []
        out = {}
        for name, raw in zip(names, values, strict=True):
            if raw is not None:
                out[name] = decode_as(InstanceInfo, raw).role
        return out

    def _scale(self, desired: dict[str, int], roles: dict[str, str]) -> None:
        stack, most = self.stack, stack_limit(self.stack)
        for role in ("prefill", "decode"):
            have = [name for name, r in roles.items() if r == role]
            if desired.get(role, 0) > len(have) and len(stack.workers) < most:
                base = stack.worker_base
                assert base is not None  # start() made the first workers
                name = f"{role}-auto-{next(self._names)}"
                worker = dataclasses.replace(base, role=role, instance_id=f"{name}-{uuid.uuid4().hex[:6]}")
                log.info("autoscaling: starting %s (the planner wants %d %s)", name, desired[role], role)
                stack.start_worker(name, worker)
            elif desired.get(role, 0) < len(have) and len(have) > 1:
                name = have[-1]
                log.info("autoscaling: stopping %s (the planner wants %d %s)", name, desired[role], role)
                stack.retire_worker(name)


def stack_limit(stack: ScaledStack) -> int:
    """The most prefill + decode workers (``--max-workers``) plus the stack's mixed ones."""
    return stack.spec.max_workers + (stack.spec.mixed or 0)
