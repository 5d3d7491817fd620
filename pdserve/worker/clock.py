"""Time as the service sees it, injected so that tests can move it (deadlines, back-offs)."""

from __future__ import annotations

import time


class Clock:
    """Wall time for deadlines (they cross processes and hosts); monotonic time for local timers."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()
