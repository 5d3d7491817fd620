"""``pdserve up --autoscale --max-workers N``: the planner runs as a child of the stack, and each new
``scale`` decision in the decisions stream starts a worker of a role with fewer instances than
desired, or drains one of a role with more, never past ``--max-workers``. Real worker processes
(the echo engine, which starts in a second) on the real Redis; the decisions are written as the
planner writes them, so the test does not wait for traffic to make one."""

from __future__ import annotations

import time

import orjson
from redis_support import run, sync_client

from pdserve.scheduler import InstanceRegistry, Keys
from pdserve.stack_autoscale import WorkerScaler
from tests.e2e.test_serving import start_stack


def live_roles(redis_url: str, keys: Keys) -> list[str]:
    async def read(redis) -> list[str]:
        return sorted(i.role for i in await InstanceRegistry(redis, keys).live() if not i.draining)

    return run(redis_url, read)


def wait_for(redis_url: str, keys: Keys, roles: list[str], timeout_s: float = 60) -> None:
    deadline, seen = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        seen = live_roles(redis_url, keys)
        if seen == sorted(roles):
            return
        time.sleep(0.2)
    raise AssertionError(f"live roles {seen}, wanted {sorted(roles)}")


def test_scale_decisions_start_and_drain_workers_within_max_workers(
    tiny_model_dir, redis_url, monkeypatch
) -> None:
    monkeypatch.setenv("PDSERVE_INTERVAL", "600")  # the planner child decides once, at its start
    stack = start_stack(
        tiny_model_dir, redis_url, prefill=1, decode=1, engine_kind="echo", autoscale=True, max_workers=3
    )
    keys, client = Keys(stack.spec.cluster), sync_client(redis_url)
    try:
        assert [name for name, _ in stack.planners] == ["planner"]
        scaler = WorkerScaler(stack, every_s=0.0)

        def decide(prefill: int, decode: int) -> None:
            decision = {"at": time.time(), "action": "scale", "reason": "test", "current": {}, "switches": []}
            decision["desired"] = {"prefill": prefill, "decode": decode, "mixed": 0}
            client.xadd(keys.plan, {"m": orjson.dumps(decision)})
            scaler.tick()

        decide(1, 2)
        wait_for(redis_url, keys, ["prefill", "decode", "decode"])
        assert [name for name, _ in stack.workers][-1] == "decode-auto-0"
        scaler.tick()  # the same decision again: nothing more
        decide(1, 5)  # past --max-workers 3: nothing started
        assert len(stack.workers) == 3
        decide(1, 1)
        wait_for(redis_url, keys, ["prefill", "decode"])
        assert [name for name, _ in stack.retired] == ["decode-auto-0"]
    finally:
        client.close()
        assert stack.stop(grace_s=15) == []
