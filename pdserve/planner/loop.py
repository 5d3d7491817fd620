"""``pdserve plan``: observe, decide, say why, and (``--apply``) switch roles; every ``--interval``.

Stateless across restarts: what the rule remembers (its last change, for the cooldowns; the last
switch's motive, still to be judged; a failed switch still to be undone and the direction held
back: ``restore.restored``) is read back from the decisions stream (``Keys.plan``) at start. The
learned prefill rate is not: the next windows teach it again. Each decision goes to that stream with its
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
from pdserve.planner.records import Decision, Motive, PlannerState, Targets
from pdserve.planner.restore import restored
from pdserve.planner.rule import decide
from pdserve.planner.switch import switch_role
from pdserve.scheduler import Keys
from pdserve.scheduler.redis_client import RedisClient
from pdserve.scheduler.redis_server import redis_errors

log = logging.getLogger(__name__)

PLAN_MAXLEN = 2000  # decisions kept (one per interval: hours of them)
ROLES = ("prefill", "decode", "mixed")
NAMES = (
    "pdserve_plan_desired_instances",
    "pdserve_plan_current_instances",
    "pdserve_plan_ttft_pressure",
    "pdserve_plan_itl_pressure",
    "pdserve_plan_queue_pressure",
    "pdserve_plan_decisions_total",
    "pdserve_plan_verdicts_total",
)


class PlannerMetrics:
    """The planner's Prometheus metrics; ``pdserve_plan_desired_instances{role}`` is the external
    metric an autoscaler scales each role's instances by."""

    def __init__(self) -> None:
        self._verdict: tuple[Motive, str, int] | None = None  # the last verdict counted
        self.registry = r = CollectorRegistry()
        self.desired = Gauge(
            "pdserve_plan_desired_instances", "instances the planner wants, per role", ["role"], registry=r
        )
        self.current = Gauge(
            "pdserve_plan_current_instances", "instances serving, per role", ["role"], registry=r
        )
        self.ttft = Gauge("pdserve_plan_ttft_pressure", "TTFT p90 over its target (1: at it)", registry=r)
        self.itl = Gauge("pdserve_plan_itl_pressure", "inter-token latency p90 over its target", registry=r)
        self.queue = Gauge(
            "pdserve_plan_queue_pressure",
            "prompt tokens queued per prefill instance over what the TTFT target allows",
            registry=r,
        )
        self.decisions = Counter(
            "pdserve_plan_decisions", "decisions by action (hold, switch, scale)", ["action"], registry=r
        )
        self.verdicts = Counter(
            "pdserve_plan_verdicts",
            "switches judged after their effect window, by outcome (relieved, failing, failed, kept)",
            ["outcome"],
            registry=r,
        )

    def update(self, decision: Decision) -> None:
        for role in ROLES:
            self.desired.labels(role).set(decision.desired.get(role, 0))
            self.current.labels(role).set(decision.current.get(role, 0))
        pairs = ((self.ttft, "ttft_pressure"), (self.itl, "itl_pressure"), (self.queue, "queue_pressure"))
        for gauge, key in pairs:
            value = decision.inputs.get(key)
            if value is not None:
                gauge.set(value)
        self.decisions.labels(decision.action).inc()
        v = decision.verdict
        if v is not None and (v.motive, v.outcome, v.failing) != self._verdict:
            # a failed switch's verdict rides on every decision until its undo: counted once
            self._verdict = (v.motive, v.outcome, v.failing)
            self.verdicts.labels(v.outcome).inc()


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
        """What the rule remembers, from the decisions stream: a restarted planner keeps its
        cooldowns, judges its last switch, undoes a failed one and keeps its direction held back."""
        with redis_errors("reading the planner's decisions"):
            entries = await self.redis.xrevrange(self.keys.plan, count=500)
        decisions = [last_decision(fields) for _, fields in entries or ()]
        self.state = restored(decisions, self.clock())
        if self.state.last_change_at > float("-inf"):
            log.info("the last change was at %.0f", self.state.last_change_at)

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
