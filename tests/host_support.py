"""What a test needs from the host (root, a tool, a library): skip with the reason where it is
missing, unless the variable saying "this host must have it" is set (CI), where it fails instead."""

from __future__ import annotations

import os
import shutil

import pytest


def missing_here(reason: str, required_by: str) -> None:
    """Skip the test for ``reason``, or fail it when ``$required_by`` is set."""
    if os.environ.get(required_by):
        pytest.fail(f"{reason} (and {required_by} is set)")
    pytest.skip(reason)


def need_root_and(*tools: str, required_by: str) -> None:
    """Root and every tool on PATH, else :func:`missing_here`."""
    missing = [t for t in tools if not shutil.which(t)]
    if os.geteuid() != 0 or missing:
        what = ["root"] if os.geteuid() != 0 else []
        missing_here(f"needs {', '.join(what + missing)}", required_by)
