"""The planner's state back from its decisions stream (``Keys.plan``), so a restarted planner keeps
its cooldowns, the switch it still has to judge, a failed one it still owes an undo and the direction
it holds back: the stream is the rule's memory (``loop.py`` reads it at start)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.planner.records import Motive, PlannerState, Verdict


def restored(decisions: Iterable[dict[str, Any]], now: float) -> PlannerState:
    """The state the rule had, from its decisions (newest first, as ``Decision.as_dict`` wrote
    them): the last change (the cooldowns), the switch whose effect is still to be judged, a failed
    switch still to be undone and the direction held back."""
    state = PlannerState()
    newer: Verdict | None = None  # the newest verdict made after the last change
    change: dict[str, Any] | None = None
    for decision in decisions:
        verdict = Verdict.from_dict(decision["verdict"]) if decision.get("verdict") else None
        if verdict is not None and state.blocked is None and verdict.outcome in ("failed", "kept"):
            state.blocked = verdict  # its hold may be over: it still counts the failures in a row
        if change is None:
            if verdict is not None and newer is None:
                newer = verdict
                if verdict.outcome == "failed" and decision["action"] == "hold":
                    state.undo = verdict
            if decision["action"] != "hold":
                change = decision
    if change is not None:
        state.last_change_at = change["at"]
        share = change["desired"]["prefill"] - change["current"]["prefill"]
        state.last_direction = (share > 0) - (share < 0)
        motive = Motive(**change["motive"]) if change.get("motive") else None
        judged = newer is not None and newer.outcome != "failing" and newer.motive == motive
        state.pending = None if judged else motive
    return state
