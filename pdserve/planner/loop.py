"""``pdserve plan``: observe, decide, say why, and (``--apply``) switch roles; every ``--interval``.

Stateless across restarts: what the rule remembers (its last change, for the cooldowns) is read
back from the decisions stream (``Keys.plan``) at start. Each decision goes to that stream with its
inputs (``pdserve status`` shows the last; ``redis-cli XREVRANGE`` the rest) and to the planner's
endpoint (``--metrics-port``, ``endpoint.py``): the desired instances per role are what
Kubernetes' autoscalers read (KEDA's metrics-api trigger, or the HPA through a metrics adapter),
and ``pdserve up --autoscale`` reads them from the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, cast

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.errors import ControlPlaneError, PdserveError
from pdserve.planner.observe import observe
from pdserve.planner.rule import Decision, PlannerState, Targets, decide
from pdserve.planner.switch import switch_role
from pdserve.scheduler import Keys
from pdserve.scheduler.connection import redis_errors
from pdserve.scheduler.redis_settings import RedisClient

log = logging.getLogger(__name__)

PLAN_MAXLEN = 2000  # decisions kept (one per interval: hours of them)
ROLES = ("prefill", "decode", "mixed")
NAMES = (
    "pdserve_plan_desired_instances",
    "pdserve_plan_current_instances",
    "pdserve_plan_ttft_pressure",
    "pdserve_plan_itl_pressure",
    "pdserve_plan_decisions_total",
)


class PlannerMetrics:
    """The planner's Prometheus metrics; ``pdserve_plan_desired_instances{role}`` is the external
    metric an autoscaler scales each role's instances by."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.desired = Gauge(
            "pdserve_plan_desired_instances", "instances the planner wants, per role", ["role"], registry=r
        )
        self.current = Gauge(
            "pdserve_plan_current_instances", "instances serving, per role", ["role"], registry=r
        )
        self.ttft = Gauge("pdserve_plan_ttft_pressure", "TTFT p90 over its target (1: at it)", registry=r)
        self.itl = Gauge("pdserve_plan_itl_pressure", "inter-token latency p90 over its target", registry=r)
        self.decisions = Counter(
            "pdserve_plan_decisions", "decisions by action (hold, switch, scale)", ["action"], registry=r
        )

    def update(self, decision: Decision) -> None:
        for role in ROLES:
            self.desired.labels(role).set(decision.desired.get(role, 0))
            self.current.labels(role).set(decision.current.get(role, 0))
        for gauge, key in ((self.ttft, "ttft_pressure"), (self.itl, "itl_pressure")):
            value = decision.inputs.get(key)
            if value is not None:
                gauge.set(value)
        self.decisions.labels(decision.action).inc()


class Planner:
    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        targets: Targets,
        model: str | None = None,
        apply: bool = False,
        metrics: PlannerMetrics | None = None,
        record: Path | None = None,
        clock: Any = time.time,
    ) -> None:
        """``apply``: perform the switches decided (else only say them); ``record``: append each
        observation to this file (JSON lines), a trace the rule can be replayed on."""
        self.redis, self.keys, self.targets, self.model = redis, keys, targets, model
        self.apply, self.metrics, self.record, self.clock = apply, metrics, record, clock
        self.state = PlannerState()
        self.last: Decision | None = None  # what the endpoint's /desired shows

    async def restore(self) -> None:
        """The last change from the decisions stream: a restarted planner keeps its cooldowns."""
        with redis_errors("reading the planner's decisions"):
            entries = await self.redis.xrevrange(self.keys.plan, count=500)
        for _, fields in entries or ():
            decision = last_decision(fields)
            if decision["action"] != "hold":
                self.state.last_change_at = decision["at"]
                share = decision["desired"]["prefill"] - decision["current"]["prefill"]
                self.state.last_direction = (share > 0) - (share < 0)
                log.info("the last change was at %.0f: %s", decision["at"], decision["reason"])
                return

    async def once(self) -> Decision | None:
        """One observation and its decision (None when no instance serves the model)."""
        obs = await observe(self.redis, self.keys, self.model, self.clock())
        if obs is None:
            return None
        if self.record is not None:
            with self.record.open("a") as f:
                f.write(json.dumps(obs.as_dict()) + "\n")
        decision = self.last = decide(obs, self.targets, self.state)
        with redis_errors("recording the planner's decision"):
            await self.redis.xadd(
                self.keys.plan, {"m": orjson.dumps(decision.as_dict())}, maxlen=PLAN_MAXLEN, approximate=True
            )
        if self.metrics is not None:
            self.metrics.update(decision)
        if decision.action != "hold":
            log.info(
                "%s: %s -> %s (%s)", decision.action, decision.current, decision.desired, decision.reason
            )
        if self.apply:
            for s in decision.switches:
                try:
                    done = await switch_role(
                        self.redis, self.keys, s.instance, s.to_role, f"planner: {decision.reason}"
                    )
                except PdserveError as e:
                    log.warning("switching %s to %s failed: %s", s.instance, s.to_role, e)
                    continue
                if not done.ok:
                    log.warning("%s did not take the role %s: %s", s.instance, s.to_role, done.error)
        return decision

    async def run(self, interval_s: float) -> None:
        """Until cancelled: one decision every ``interval_s``."""
        await self.restore()
        while True:
            try:
                await self.once()
            except ControlPlaneError as e:
                log.warning("planner: %s", e)
            await asyncio.sleep(interval_s)


def last_decision(fields: Any) -> dict[str, Any]:
    """A decisions-stream entry's decision (``pdserve status``, ``up --autoscale``), whether the
    client decodes replies or not."""
    value = fields.get(b"m", fields.get("m")) if isinstance(fields, dict) else None
    if value is None:
        raise PdserveError("a planner decision without its 'm' field")
    return cast(dict[str, Any], orjson.loads(value))
