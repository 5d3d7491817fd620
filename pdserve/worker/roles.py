"""An instance's role, and how it changes while it serves (``SetRole``: ``pdserve role``, a planner).

The role is what routers read in the registration: which work they send the instance (prefill of
split requests, decode of split requests, or whole requests). The engine itself does all three, so
a switch changes only that: the registration says the new role at once (the next heartbeat is
pushed then), new work follows it, and work of the old role already here finishes where it is: a
prefill's hand-off in flight writes its KV and ends, a decode's sequences decode to their end, a
lease a prefill reserved before the switch is written and decoded. No request fails or is retried
because of a switch, and the KV pool and the prefix cache stay as they are.

What a role needs: a decode instance's cache must be reachable by its peers' writers (in shared
memory, with the transports' local sides open), a prefill's transports open to write. A worker
started ``--switchable`` has both whatever its role; otherwise a switch to a role its start did not
prepare for is refused with the reason (the registration's ``last_switch`` says it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.scheduler import RoleChange, SetRole, SwitchOutcome

log = logging.getLogger(__name__)

HISTORY = 8  # the registration keeps the last few roles taken


class RoleState:
    def __init__(
        self,
        role: str,
        *,
        shared_cache: bool,
        transports: Callable[[], bool],
        now: Callable[[], float],
        switchable: bool = False,
    ) -> None:
        """``shared_cache``: peers can write into this instance's cache (its segment);
        ``transports()``: whether KV transports are open here; ``now``: wall time (unix s)."""
        self.role = role
        self.switchable = switchable
        self.shared_cache = shared_cache
        self._transports = transports
        self._now = now
        self.history: list[RoleChange] = []
        self.last_switch: SwitchOutcome | None = None

    def why_not(self, role: str) -> str | None:
        """Why this instance cannot take ``role`` now; None when it can."""
        if role == "decode" and not self.shared_cache:
            return "its KV cache is not where peers can write it (start the worker with --switchable)"
        if role in ("prefill", "decode") and not self._transports():
            return "it opened no KV transport (start the worker with --switchable)"
        return None

    def switch(self, msg: SetRole, draining: bool = False) -> SwitchOutcome:
        """Take ``msg.role`` now, or refuse with the reason; the outcome is also ``last_switch``."""
        error = "it is draining" if draining else self.why_not(msg.role)
        if error is None and msg.role != self.role:
            log.info(
                "role %s -> %s (%s); work of the old role here finishes where it is",
                self.role,
                msg.role,
                msg.reason or "asked",
            )
            self.role = msg.role
            self.history = [*self.history, RoleChange(role=msg.role, at=self._now(), reason=msg.reason)][
                -HISTORY:
            ]
        elif error is not None:
            log.warning("refusing to become %s (switch %s): %s", msg.role, msg.request_id, error)
        self.last_switch = SwitchOutcome(id=msg.request_id, role=msg.role, ok=error is None, error=error)
        return self.last_switch
