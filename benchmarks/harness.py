"""What every benchmark here shares, so that each script holds only what it measures: the facts of
the machine it ran on, repeated rounds and their medians, the table it prints and the JSON it writes
(and, for the scripts that start a pdserve stack, its layout and the model it serves).

Every script's JSON has one shape: ``{"machine": {...}, "args": {...}, ...its figures}`` (its figures
under the keys it always wrote them: ``rows``, ``results``, ``median``, ``presets``...). The tables
are rich tables in Markdown form, so that a run's output pastes into docs/benchmarks.md as it is.

    from harness import print_table, run_rounds, medians, write_json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata as md
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from pdserve.engine.cpu.host_cpu import detect, usable_cores

if TYPE_CHECKING:
    from pdserve.stack import Stack

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
T = TypeVar("T")

# the CPU features the kernels choose by (numba, MKL, the int8 GEMMs): /proc/cpuinfo's names
FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
PACKAGES = ("pdserve", "numpy", "paddlepaddle", "numba", "torch", "transformers", "redis", "uvicorn")


# ---- the machine ---------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, as the engine reads it), else what the platform module says."""
    return detect().model or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """Which of :data:`FLAGS` this CPU has."""
    have = detect().flags
    return [f for f in FLAGS if f in have]


def memory_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def git_revision() -> str | None:
    """The checkout's commit, with ``+dirty`` where its tracked files differ from it."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) or None


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    """The installed versions of ``names`` (without importing them); those not installed left out."""
    out = {}
    for name in names:
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    return out


def nvidia_smi() -> str | None:
    """The GPUs nvidia-smi names (name, memory, driver, clocks), where it is installed."""
    if shutil.which("nvidia-smi") is None:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    return None


@functools.cache
def _static_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "affinity": usable_cores(),
        "flags": cpu_flags(),
        "memory_bytes": memory_bytes(),
        "host": platform.node(),
        "git": git_revision(),
        "python": sys.version.split()[0],
        "packages": package_versions(),
    }
    smi = nvidia_smi()
    if smi:
        facts["nvidia_smi"] = smi
    return facts


def machine() -> dict[str, Any]:
    """What the figures depend on: CPU model, cores (and how many this process may run on), the
    instruction sets the kernels choose by, memory, the GPU where there is one, the commit, the
    versions, the date and the load average when asked."""
    return {
        **_static_facts(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg": list(os.getloadavg()),
    }


# ---- rounds --------------------------------------------------------------------------------------
def run_rounds(n: int, one: Callable[[int], T], what: str = "round") -> list[T]:
    """``one(i)`` for i in 0..n-1, saying on stderr which is running (each round alternates whatever
    the script compares, so a drift of the machine falls on every variant alike)."""
    out = []
    for i in range(n):
        print(f"{what} {i + 1}/{n} ...", file=sys.stderr, flush=True)
        out.append(one(i))
    return out


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are there (None where none is)."""
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def medians(rounds: Sequence[Any]) -> Any:
    """The rounds' medians, key by key: dicts of the same keys are merged recursively, numbers are
    replaced by their median, anything else keeps the first round's value."""
    first = next((r for r in rounds if r is not None), None)
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for r in rounds if isinstance(r, dict) for k in r))
        return {k: medians([r.get(k) for r in rounds if isinstance(r, dict)]) for k in keys}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return median(r for r in rounds if isinstance(r, (int, float)))
    return first


# ---- the table -----------------------------------------------------------------------------------
def fmt(x: Any, spec: str = ".1f", none: str = "-") -> str:
    """``x`` formatted by ``spec``; ``none`` where there is no figure."""
    return none if x is None else format(x, spec)


def print_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None, file: Any = None
) -> None:
    """One table in Markdown form (its first column left-aligned, the figures right-aligned)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    lead = "\n" if title and title.startswith("\n") else ""
    table = Table(
        *headers, title=title and title.strip(), box=box.MARKDOWN, title_justify="left", show_edge=True
    )
    for i, col in enumerate(table.columns):
        col.justify = "left" if i == 0 else "right"
        col.no_wrap = True
    for row in rows:
        table.add_row(*("" if c is None else str(c) for c in row))
    buf = io.StringIO()
    Console(file=buf, width=250, highlight=False, soft_wrap=True, color_system=None).print(table)
    lines = [line.rstrip() for line in buf.getvalue().splitlines() if line.strip()]
    print(lead + "\n".join(lines), file=file or sys.stdout, flush=True)


# ---- the JSON ------------------------------------------------------------------------------------
def args_dict(args: argparse.Namespace | dict | None) -> dict[str, Any]:
    """The command line's options, JSON-safe (paths as strings)."""
    items = vars(args).items() if isinstance(args, argparse.Namespace) else (args or {}).items()
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in items}


def document(content: dict | list, args: argparse.Namespace | dict | None = None) -> dict[str, Any]:
    """``{"machine", "args", ...content}``: a list is put under ``rows``; the content's own
    ``machine`` facts are kept over the harness's."""
    body: dict[str, Any] = {"rows": content} if isinstance(content, list) else dict(content)
    own: dict[str, Any] = body.pop("machine", None) or {}
    return {"machine": {**machine(), **own}, "args": args_dict(args), **body}


def write_json(
    path: Path, content: dict | list, args: argparse.Namespace | dict | None = None, quiet: bool = False
) -> dict[str, Any]:
    """Write :func:`document` of ``content`` to ``path`` whole (a temporary file renamed: a reader
    finds the previous version or the next, never half of one); returns what was written."""
    doc = document(content, args)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=_json_default))
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}", file=sys.stderr, flush=True)
    return doc


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    with contextlib.suppress(TypeError, ValueError):
        return float(x)  # numpy scalars
    return str(x)


# ---- a pdserve stack -----------------------------------------------------------------------------
class Layout(TypedDict, total=False):
    """A stack's instance counts, as StackSpec's keyword arguments: ``StackSpec(..., **layout)``."""

    prefill: int
    decode: int
    mixed: int


def served_model(stack: Stack) -> str:
    """The model name a started stack serves (``Stack.start()`` resolves the model)."""
    if stack.model is None:
        raise RuntimeError("the stack has no model yet: Stack.start() resolves it, call it first")
    return stack.model.name
