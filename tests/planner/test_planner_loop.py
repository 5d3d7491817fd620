"""The planner against a real Redis: it reads what instances and routers register (a router's
traffic window made from its real metrics), records each decision in the stream that ``pdserve
status`` shows, serves the desired counts on its endpoint (JSON for KEDA, Prometheus text), and
a restarted planner keeps the cooldown of the change it made before."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families
from redis_support import run
from router_support import instance

from pdserve.localredis.embedded import free_port
from pdserve.planner.endpoint import endpoint_app, serve_endpoint
from pdserve.planner.loop import Planner, PlannerMetrics
from pdserve.planner.observe import observation
from pdserve.planner.records import PlannerState, Targets
from pdserve.planner.rule import pressures
from pdserve.router.http.metrics import RouterMetrics
from pdserve.router.http.traffic import TrafficWindow
from pdserve.scheduler import InstanceRegistry, Keys, RouterInfo, RouterRegistry
from pdserve.scheduler.outbox_messages import RequestDelta, Usage
from pdserve.scheduler.registration import RoleChange
from pdserve.status_read import read
from pdserve.status_table import render

CLUSTER = "plan-test"
KEYS = Keys(CLUSTER)
TARGETS = Targets(ttft_p90_s=1.0, itl_p90_s=0.1, patience=2, cooldown_s=600, min_requests=10)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slow_prefill_traffic(clock: Clock) -> TrafficWindow:
    """A router's window with 40 requests of TTFT ~3 s (3x the target) and ITL ~20 ms."""
    metrics = RouterMetrics()
    window = TrafficWindow(metrics, 30.0, clock)
    window.info()  # the base snapshot
    for _ in range(40):
        metrics.ttft.observe(3.0)
        metrics.itl.observe(0.02)
        metrics.e2e.observe(3.5)
    clock.now += 5
    return window


def test_the_traffic_window_counts_what_was_served_within_it() -> None:
    clock = Clock()
    window = slow_prefill_traffic(clock)
    info = window.info()
    assert (info.requests, info.window_s, sum(info.ttft_counts), sum(info.itl_counts)) == (40, 5.0, 40, 40)
    clock.now += 40  # past the window with nothing new: the 40 leave it
    window.info()
    clock.now += 1
    assert window.info().requests == 0


def test_the_traffic_window_counts_what_arrived_before_it_finishes() -> None:
    """Choices placed count at once (their prompt tokens and max_tokens where known); of the
    finished ones with a max_tokens, what was asked and what was generated."""
    clock, metrics = Clock(), RouterMetrics()
    window = TrafficWindow(metrics, 30.0, clock)
    window.info()
    metrics.on_arrival(512, 24)
    metrics.on_arrival(None, 128)  # a text prompt not tokenized
    metrics.on_arrival(64, None)  # no max_tokens: the worker fills the model length in
    usage = RequestDelta(
        request_id="r", finish_reason="stop", usage=Usage(prompt_tokens=512, completion_tokens=10)
    )
    metrics.on_delta(usage, False, 0.0, 0.0, 1.0, max_tokens=24)
    clock.now += 5
    info = window.info()
    assert (info.arrivals, info.arrival_prompt_tokens, info.arrival_prompt_known) == (3, 576, 2)
    assert (info.arrival_max_tokens, info.arrival_max_known) == (152, 2)
    assert (info.finished_asked, info.finished_generated, info.requests) == (24, 10, 1)
    clock.now += 40
    window.info()
    clock.now += 1
    assert window.info().arrivals == 0


def test_the_latencies_are_trusted_from_requests_streaming_before_any_finishes() -> None:
    """Long answers finish a window or more after their tokens filled the inter-token histogram:
    the p90s rest on the requests whose first token came in the window, none finished yet."""
    clock, metrics = Clock(), RouterMetrics()
    window = TrafficWindow(metrics, 30.0, clock)
    window.info()
    for _ in range(12):
        metrics.ttft.observe(0.5)
        for _ in range(20):
            metrics.itl.observe(0.3)  # 3x the inter-token target
    clock.now += 5
    router = RouterInfo(id="r1", host="h", pid=1, port=1, started_at=time.time(), traffic=window.info())
    members = [instance("p", "prefill"), instance("d", "decode")]
    obs = observation(members, [router], members[0].model, 0.0)
    assert (obs.requests, obs.first_tokens, obs.latency_samples) == (0, 12, 12)
    pr = pressures(obs, TARGETS, PlannerState())
    assert pr.trusted and pr.decode is not None and pr.decode > 2.5
    fewer = pressures(
        dataclasses.replace(obs, first_tokens=TARGETS.min_requests - 1), TARGETS, PlannerState()
    )
    assert not fewer.trusted and fewer.decode is None


def test_the_planner_decides_records_exports_and_remembers(redis_url: str) -> None:
    async def main(redis) -> None:
        await redis.delete(KEYS.plan)
        instances = InstanceRegistry(redis, KEYS)
        for n, role in enumerate(("prefill", "prefill", "decode", "decode")):
            info = instance(f"i{n}-{role}", role, waiting=n)
            await instances.register(info.model_copy(update={"switchable": role == "decode" or None}))
        traffic = slow_prefill_traffic(Clock()).info()
        router = RouterInfo(id="r1", host="h", pid=1, port=1, started_at=time.time(), traffic=traffic)
        await RouterRegistry(redis, KEYS).register(router)

        metrics, port = PlannerMetrics(), free_port()
        planner = Planner(redis, KEYS, TARGETS, metrics=metrics)
        started = asyncio.Event()
        endpoint = asyncio.create_task(
            serve_endpoint(endpoint_app(metrics, lambda: planner.last), "127.0.0.1", port, started)
        )
        url = f"http://127.0.0.1:{port}"
        try:
            await asyncio.wait_for(started.wait(), 10)
            async with httpx.AsyncClient(base_url=url, timeout=5) as http:
                early = await http.get("/desired")
                assert early.status_code == 503 and early.json()["error"]["code"] == "no_decision"
                first = await planner.once()
                assert first is not None and first.action == "hold" and "waiting (1/2)" in first.reason
                second = await planner.once()
                assert second is not None and second.action == "switch"
                assert [(s.instance, s.to_role) for s in second.switches] == [("i2-decode", "prefill")]
                wanted = (await http.get("/desired")).json()  # what KEDA's metrics-api trigger reads
                text = (await http.get("/metrics")).text
        finally:
            endpoint.cancel()
            await asyncio.gather(endpoint, return_exceptions=True)
        assert (wanted["prefill"], wanted["decode"], wanted["workers"], wanted["action"]) == (
            3,
            1,
            4,
            "switch",
        )
        assert wanted["switchable"] == 2  # of the 4, the 2 started as prefill instances cannot switch
        desired = {
            s.labels["role"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "pdserve_plan_desired_instances"
        }
        assert desired == {"prefill": 3.0, "decode": 1.0, "mixed": 0.0}
        assert await redis.xlen(KEYS.plan) == 2

        # what pdserve status shows: the planner's last decision, and a switched instance's roles
        await instances.register(
            instance("i2-decode", "prefill").model_copy(
                update={"roles": [RoleChange(role="prefill", at=time.time(), reason="planner")]}
            )
        )
        shown = render(await read(redis, CLUSTER))
        assert "planner (" in shown and "switch, prefill 2 -> 3, decode 2 -> 1" in shown
        assert "[i2-decode decode -> prefill]" in shown
        assert "i2-decode roles: prefill at" in shown

        await instances.register(instance("i2-decode", "decode"))  # as if the switch had not been made
        restarted = Planner(redis, KEYS, TARGETS)  # keeps the 600 s cooldown of that change
        await restarted.restore()
        for _ in range(2):
            again = await restarted.once()
        assert again is not None and again.action == "hold" and "cooling down" in again.reason

    run(redis_url, main)


def test_a_restarted_planner_reads_a_failed_switch_back_from_the_stream(redis_url: str) -> None:
    """The decisions of a switch that did not help, up to its failed verdict, as the planner wrote
    them: a planner started then still owes the undo (and its metrics count the verdict once)."""
    from test_rule_signals import TARGETS as WORLD_TARGETS
    from test_rule_signals import decode_short_world, run_world

    decisions = run_world(decode_short_world, WORLD_TARGETS, 120)
    failed_at = next(d.at for d in decisions if d.verdict is not None and d.verdict.outcome == "failed")

    async def main(redis) -> None:
        await redis.delete(KEYS.plan)
        for d in decisions:
            if d.at <= failed_at:
                await redis.xadd(KEYS.plan, {"m": orjson.dumps(d.as_dict())})
        planner = Planner(redis, KEYS, WORLD_TARGETS, clock=lambda: failed_at + 5)
        await planner.restore()
        assert planner.state.undo is not None and planner.state.undo.motive.direction == -1
        assert planner.state.blocked is not None and planner.state.pending is None
        assert planner.state.last_change_at == next(d.at for d in decisions if d.action == "switch")

    run(redis_url, main)
    metrics = PlannerMetrics()
    for d in decisions:
        metrics.update(d)
    failed = metrics.registry.get_sample_value("pdserve_plan_verdicts_total", {"outcome": "failed"})
    assert failed == 1  # the undo and the holds before it carry the same verdict
