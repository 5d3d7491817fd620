"""``pdserve status``'s roles section: each instance's role history and the planner's last decision.

Both are read from what already is in Redis: an instance registers the roles it took since its
start (``InstanceInfo.roles``) and the outcome of the last switch it was asked for; the planner
appends every decision to ``Keys.plan``, of which the status reads the newest.
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.errors import PdserveError
from pdserve.planner.loop import last_decision
from pdserve.scheduler import InstanceInfo, Keys


def role_history(info: InstanceInfo) -> dict[str, Any] | None:
    """An instance's switches for the status (None: it never was asked to switch)."""
    if not info.roles and info.last_switch is None:
        return None
    return {
        "roles": [r.model_dump() for r in info.roles or ()],
        "last_switch": info.last_switch.model_dump() if info.last_switch else None,
        "switchable": bool(info.switchable),
    }


async def last_plan(redis: Any, keys: Keys) -> dict[str, Any] | None:
    """The planner's newest decision (None: no planner ever ran on this cluster)."""
    entries = await redis.xrevrange(keys.plan, count=1)
    if not entries:
        return None
    try:
        return last_decision(entries[0][1])
    except (PdserveError, ValueError) as e:
        return {"unreadable": str(e)}


def role_lines(status: dict[str, Any]) -> list[str]:
    """A blank line, then each switched instance's roles, oldest first, and the planner's last
    decision with its inputs; nothing when no instance switched and no planner ran."""
    lines = []
    for i in status["instances"]:
        history = i.get("role_history")
        if not history:
            continue
        steps = [
            f"{r['role']} at {_clock(r['at'])}" + (f" ({r['reason']})" if r.get("reason") else "")
            for r in history["roles"]
        ]
        line = f"{i['id']} roles: " + (", then ".join(steps) if steps else f"{i['role']} since its start")
        last = history.get("last_switch")
        if last and not last["ok"]:
            line += f"; its last switch, to {last['role']}, was refused: {last['error']}"
        lines.append(line)
    plan = status.get("plan")
    if plan:
        lines.append(plan_line(plan))
    return ["", *lines] if lines else []


def plan_line(plan: dict[str, Any]) -> str:
    """``planner (12 s ago): switch, prefill 2 -> 3, decode 2 -> 1: TTFT p90 at 1.40x ...``"""
    if "unreadable" in plan:
        return f"planner: its last decision is unreadable: {plan['unreadable']}"
    ago = max(0.0, time.time() - plan["at"])
    current, desired = plan["current"], plan["desired"]
    split = ", ".join(
        f"{role} {current.get(role, 0)}"
        + (f" -> {desired[role]}" if desired.get(role, 0) != current.get(role, 0) else "")
        for role in ("prefill", "decode", "mixed")
        if current.get(role) or desired.get(role)
    )
    inputs = plan.get("inputs", {})
    seen = ", ".join(
        f"{label} {inputs[key]:.3f} s"
        for label, key in (("TTFT p90", "ttft_p90_s"), ("inter-token p90", "itl_p90_s"))
        if inputs.get(key) is not None
    )
    moves = "; ".join(f"{s['instance']} {s['from_role']} -> {s['to_role']}" for s in plan.get("switches", ()))
    return (
        f"planner ({ago:.0f} s ago): {plan['action']}, {split}: {plan['reason']}"
        + (f" [{moves}]" if moves else "")
        + (
            f" ({seen}, {inputs.get('requests', 0)} requests in the last {inputs.get('window_s', 0):.0f} s)"
            if seen
            else ""
        )
    )


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))
