"""How much CPU this instance's host has left over lately, for the planner: another instance of a
role adds that role capacity only where it gets cores of its own. On a 2-core host running four
one-thread workers, a third decode instance shares the two cores the other two already keep busy:
plan_bench measured 1:3 worse than 2:2 on such a host, in the very phase the planner moved to it.

The CPUs are the ones this process may run on (its affinity mask), within its cgroup's CPU quota
where it has one (a container's or a Kubernetes pod's limit); idle is what those CPUs did not run
(anything: other instances, the router, Redis, other tenants) over the last :data:`WINDOW_S`,
sampled at each heartbeat (psutil's per-CPU times, cgroup v2's ``cpu.stat``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from pdserve.engine.cpu.host_cpu import allowed_cpus
from pdserve.scheduler import IdleCpuInfo

WINDOW_S = 10.0
"""The span idle CPU is averaged over: long enough that one busy heartbeat does not read as a
saturated host, short enough to follow a traffic shift within the planner's patience."""

CGROUP = Path("/sys/fs/cgroup")


@dataclasses.dataclass(frozen=True)
class _Sample:
    at: float  # monotonic s
    busy_s: float  # CPU seconds the allowed CPUs ran anything, since boot
    quota_busy_s: float | None  # CPU seconds this cgroup ran, since it began (None: no quota)


class IdleCpuMeter:
    """The idle CPUs of this process's host over the last :data:`WINDOW_S`, from a sample per call."""

    def __init__(
        self, threads: int, root: Path | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.threads = threads
        self.root = own_cgroup() if root is None else root  # where cpu.max and cpu.stat are
        self.clock = clock
        self.cpus_allowed = allowed_cpus()
        self.quota = _cgroup_quota(self.root)
        self.samples: collections.deque[_Sample] = collections.deque()

    @property
    def cpus(self) -> float:
        """The CPUs this process may use: its affinity mask, within its cgroup's quota."""
        n = float(len(self.cpus_allowed))
        return min(n, self.quota) if self.quota is not None else n

    def sample(self) -> IdleCpuInfo | None:
        """Take a sample; the idle CPUs since the oldest one within the window (None until two
        samples are a second apart, or where the host's CPU times cannot be read)."""
        now = self.clock()
        try:
            times = psutil.cpu_times(percpu=True)
        except (OSError, RuntimeError):
            return None
        busy = sum(_busy(times[i]) for i in self.cpus_allowed if i < len(times))
        self.samples.append(_Sample(now, busy, _cgroup_usage_s(self.root) if self.quota else None))
        while len(self.samples) > 2 and now - self.samples[1].at >= WINDOW_S:
            self.samples.popleft()
        first, last = self.samples[0], self.samples[-1]
        span = last.at - first.at
        if span < 1.0:
            return None
        idle = len(self.cpus_allowed) - (last.busy_s - first.busy_s) / span
        if self.quota is not None and first.quota_busy_s is not None and last.quota_busy_s is not None:
            idle = min(idle, self.quota - (last.quota_busy_s - first.quota_busy_s) / span)
        return IdleCpuInfo(cpus=round(self.cpus, 2), idle=round(max(idle, 0.0), 2), threads=self.threads)


def _busy(t: Any) -> float:
    """Seconds a CPU (psutil's per-CPU times) ran anything; a hypervisor's steal counts as busy: it
    was not ours to use. Fields other systems lack count as 0."""
    return t.user + t.nice + t.system + sum(getattr(t, f, 0.0) for f in ("irq", "softirq", "steal"))


def own_cgroup(root: Path = CGROUP) -> Path:
    """This process's cgroup v2 directory (``/proc/self/cgroup``'s ``0::<path>``; in a container's
    cgroup namespace that is ``/``, the root)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return root / line[3:].strip().lstrip("/")
    return root


def _cgroup_quota(root: Path) -> float | None:
    """CPUs' worth of time cgroup v2's ``cpu.max`` allows (None: no limit, or no cgroup v2)."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
    return None


def _cgroup_usage_s(root: Path) -> float | None:
    """CPU seconds this cgroup ran (``cpu.stat``'s ``usage_usec``)."""
    with contextlib.suppress(OSError, ValueError):
        for line in (root / "cpu.stat").read_text().splitlines():
            name, value = line.split()
            if name == "usage_usec":
                return int(value) / 1e6
    return None
