"""What a router has served lately, published with its registration (``RouterInfo.traffic``): the
planner reads it from Redis (``pdserve plan``), with no scrape of any router's ``/metrics``.

Every heartbeat takes a snapshot of the router's own metrics (the TTFT and inter-token latency
histograms' bucket counts, the token, prefix and KV transfer counters): a few list copies. The
published figures are the difference between the newest snapshot and the oldest one within the
window (``--traffic-window``, 30 s): requests finished, their tokens, and the two histograms'
bucket counts over that window (with the bounds), which a reader merges across routers before it
takes a quantile; and what arrived in it (``RouterMetrics.asked``): choices placed, their prompt
tokens and ``max_tokens`` where known, and of the finished ones the tokens asked and generated (the
planner's demand, ``planner/demand.py``).
"""

from __future__ import annotations

import collections
import copy
import time
from collections.abc import Callable

from pdserve.router.http.metrics import ITL_BUCKETS, LATENCY_BUCKETS, RouterMetrics
from pdserve.scheduler.registration import TrafficInfo


class _Snapshot:
    __slots__ = (
        "asked",
        "at",
        "generation",
        "hit",
        "itl",
        "lookup",
        "prompt",
        "requests",
        "transfer_s",
        "transfers",
        "ttft",
    )

    def __init__(self, metrics: RouterMetrics, at: float) -> None:
        self.at = at
        self.ttft = list(metrics.ttft.series().counts)
        self.itl = list(metrics.itl.series().counts)
        self.requests = sum(metrics.e2e.series().counts)
        self.prompt = metrics.prompt_tokens.values.get((), 0.0)
        self.generation = metrics.generation_tokens.values.get((), 0.0)
        self.lookup = metrics.prefix_lookup_tokens.values.get((), 0.0)
        self.hit = metrics.prefix_hit_tokens.values.get((), 0.0)
        transfer = metrics.kv_transfer.series()
        self.transfers, self.transfer_s = sum(transfer.counts), transfer.sum
        self.asked = copy.copy(metrics.asked)


class TrafficWindow:
    """The router's traffic over the last ``window_s``, from its metrics (None without metrics)."""

    def __init__(
        self, metrics: RouterMetrics, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.metrics, self.window_s, self.clock = metrics, window_s, clock
        self._snapshots: collections.deque[_Snapshot] = collections.deque()

    def info(self) -> TrafficInfo:
        """A new snapshot, and the traffic since the oldest one still within the window."""
        now = _Snapshot(self.metrics, self.clock())
        snaps = self._snapshots
        snaps.append(now)
        while len(snaps) > 2 and now.at - snaps[1].at >= self.window_s:
            snaps.popleft()  # keep the last snapshot at least a window old as the base
        base = snaps[0]
        return TrafficInfo(
            window_s=round(now.at - base.at, 3),
            requests=now.requests - base.requests,
            prompt_tokens=int(now.prompt - base.prompt),
            generation_tokens=int(now.generation - base.generation),
            ttft_bounds=list(LATENCY_BUCKETS),
            ttft_counts=[a - b for a, b in zip(now.ttft, base.ttft)],
            itl_bounds=list(ITL_BUCKETS),
            itl_counts=[a - b for a, b in zip(now.itl, base.itl)],
            prefix_lookup_tokens=int(now.lookup - base.lookup),
            prefix_hit_tokens=int(now.hit - base.hit),
            kv_transfers=now.transfers - base.transfers,
            kv_transfer_s=round(now.transfer_s - base.transfer_s, 6),
            arrivals=now.asked.arrivals - base.asked.arrivals,
            arrival_prompt_tokens=now.asked.prompt_tokens - base.asked.prompt_tokens,
            arrival_prompt_known=now.asked.prompt_known - base.asked.prompt_known,
            arrival_max_tokens=now.asked.max_tokens - base.asked.max_tokens,
            arrival_max_known=now.asked.max_known - base.asked.max_known,
            finished_asked=now.asked.finished_asked - base.asked.finished_asked,
            finished_generated=now.asked.finished_generated - base.asked.finished_generated,
        )
