"""The decode-step timing every engine benchmark here shares (standard library only, so vLLM's
separate environment imports it too)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_step_ms(step: Callable[[int], object], steps: int) -> float:
    """The median wall time, in ms, of ``step(i)`` for i in 0 .. steps - 1 (median: this machine's
    noise comes in bursts)."""
    times = []
    for i in range(steps):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def decode_figures(batch: int, ms: float) -> dict[str, float]:
    """engine_bench's result keys for one decode batch size timed at ``ms`` per step."""
    return {f"decode_b{batch}_ms": ms, f"decode_b{batch}_tok_s": batch * 1000 / ms}
