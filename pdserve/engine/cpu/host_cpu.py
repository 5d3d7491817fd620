"""What this CPU can run, decided once before Paddle is imported (docs/design.md "CPU kernels").

Paddle's CPU wheel does not check the CPU everywhere: ``fused_rms_norm`` (kernel
``RmsNormAvxKernel``, and ``paddle.nn.functional.rms_norm``, which runs it) executes AVX-512F
instructions (``zmm`` registers, ``kmovw`` masks) unconditionally, so on an AVX2-only CPU the
process dies by SIGILL. A signal cannot be caught, so the choice is made from the CPU's features:
fused kernels only where their instructions exist, a composed fallback everywhere else.

Paddle bundles MKL 2019.5, which takes a generic code path on AMD CPUs unless
``MKL_DEBUG_CPU_TYPE=5`` is set before MKL loads (GEMMs ~3x faster on Zen 3); pdserve sets it
on AMD when the user has not set the variable (``MKL_DEBUG_CPU_TYPE=`` keeps MKL's own choice).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
from collections.abc import MutableMapping
from pathlib import Path
from typing import Literal

from pdserve.engine.config import KERNEL_MODES
from pdserve.engine.kernel_choice import check_mode
from pdserve.errors import ConfigError

log = logging.getLogger(__name__)

# The supported floor on x86-64: what Paddle's CPU wheel and MKL's fast paths are built for.
X86_FLOOR = ("avx", "avx2", "fma")
# Instructions Paddle's fused_rms_norm CPU kernel executes (read from its disassembly).
FUSED_RMS_NORM_NEEDS = ("avx512f",)

KernelMode = Literal["auto", "fused", "composed"]
Impl = Literal["fused", "composed"]


@dataclasses.dataclass(frozen=True)
class CpuInfo:
    arch: str  # platform.machine(): x86_64, aarch64, ...
    vendor: str  # cpuinfo vendor_id: GenuineIntel, AuthenticAMD, "" when unknown
    model: str
    flags: frozenset[str]

    @property
    def is_x86(self) -> bool:
        return self.arch.lower() in ("x86_64", "amd64", "i686", "i386")

    @property
    def is_amd(self) -> bool:
        return self.vendor == "AuthenticAMD"

    def missing(self, features: tuple[str, ...]) -> list[str]:
        return [f for f in features if f not in self.flags]

    def describe(self) -> str:
        simd: list[str] = [f for f in ("avx2", "avx512f", "amx_tile") if f in self.flags] or ["no AVX2"]
        return f"{self.model or self.arch} ({self.vendor or 'unknown vendor'}; {', '.join(simd)})"


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, by number (its affinity mask: taskset, cpusets, a
    container's cpuset), not the machine's."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many cores this process may run on (:func:`allowed_cpus`): the default thread count of
    an engine and of `up`'s workers."""
    return len(allowed_cpus())


def parse_cpuinfo(text: str, arch: str) -> CpuInfo:
    """Read the first processor's ``vendor_id``, ``model name`` and ``flags`` from /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # end of the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return CpuInfo(
        arch=arch,
        vendor=fields.get("vendor_id", ""),
        model=fields.get("model name", ""),
        flags=frozenset(fields.get("flags", "").split()),
    )


def detect(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text, platform.machine())


def check_floor(info: CpuInfo) -> None:
    """Refuse a CPU that Paddle's wheel would crash on, naming what it lacks."""
    if not info.is_x86 or not info.flags:
        return  # no x86 feature list to judge by (another architecture, or no /proc): let Paddle try
    missing = info.missing(X86_FLOOR)
    if missing:
        raise ConfigError(
            f"this CPU ({info.describe()}) lacks {', '.join(missing)}; pdserve's Paddle CPU build needs "
            f"an x86-64 CPU with {', '.join(X86_FLOOR)} (Intel Haswell / AMD Zen or newer)"
        )


def tune_environment(info: CpuInfo, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set what makes Paddle's bundled libraries fast on this CPU; returns the settings applied.

    Must run before Paddle (and so MKL) is imported. A variable the user set is left alone.
    """
    environ = os.environ if environ is None else environ
    applied = []
    if info.is_amd and "MKL_DEBUG_CPU_TYPE" not in environ:
        environ["MKL_DEBUG_CPU_TYPE"] = "5"  # MKL <= 2020.0: use the AVX2 kernels on AMD
        applied.append("MKL_DEBUG_CPU_TYPE=5")
    return applied


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which implementation of each fused op the model runs, and why."""

    rms_norm: Impl
    swiglu: Impl
    reason: str

    def describe(self) -> str:
        return f"rms_norm={self.rms_norm}, swiglu={self.swiglu} ({self.reason})"


def choose_kernels(mode: str, info: CpuInfo) -> Kernels:
    """``auto``: fused where this CPU runs it; ``composed``: plain ops everywhere (the path every
    CPU can run, forced in tests); ``fused``: fused everywhere, refused where the CPU lacks it."""
    check_mode("kernels", mode, KERNEL_MODES)
    if mode == "composed":
        return Kernels("composed", "composed", "composed path forced")
    # swiglu's CPU kernel runs on the floor (measured on an AVX2-only AMD Zen 3, in the test suite).
    missing = info.missing(FUSED_RMS_NORM_NEEDS) if info.is_x86 else ["an x86-64 CPU"]
    if not missing:
        return Kernels("fused", "fused", f"CPU has {', '.join(FUSED_RMS_NORM_NEEDS)}")
    if mode == "fused":
        raise ConfigError(
            f"kernels=fused: Paddle's fused_rms_norm needs {', '.join(missing)}, which this CPU "
            f"({info.describe()}) lacks; use kernels=auto or composed"
        )
    return Kernels("composed", "fused", f"no {', '.join(missing)}: composed rms_norm")
