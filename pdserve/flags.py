"""Command-line flags whose defaults come from ``PDSERVE_<FLAG>`` environment variables.

Shared by ``pdserve.cli`` and ``pdserve.router.settings``; imports nothing from pdserve, so any
layer may use it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


def env(name: str, default: Any = None, kind: Callable[[str], Any] = str) -> Any:
    """Default for a flag from ``PDSERVE_<NAME>``; a malformed value names the variable."""
    raw = os.environ.get(f"PDSERVE_{name}")
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(
            f"pdserve: error: environment variable PDSERVE_{name}={raw!r} is not a valid {kind.__name__}"
        ) from None


def add_flag(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    name: str,
    kind: Callable[[str], Any],
    default: Any,
    help: str,
    **kw: Any,
) -> None:
    """``--some-flag`` defaulting from ``PDSERVE_SOME_FLAG``, which its help names."""
    var = name.lstrip("-").upper().replace("-", "_")
    p.add_argument(name, type=kind, default=env(var, default, kind), help=f"{help} [env PDSERVE_{var}]", **kw)


def boolean(raw: str) -> bool:
    """A flag or variable value: 1/true/yes/on or 0/false/no/off."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)
