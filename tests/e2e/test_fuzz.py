"""Schemathesis against the router's /openapi.json: generated and fuzzed requests for every
operation (the generation endpoints and ``POST /v1/batches`` included, with their request schemas)
never get a 5xx. ``fuzz_hooks.py`` makes numbers long, and strings and mapping keys digits, in the
generated bodies (past the 4300 digits Python's ``int()`` reads: ``logit_bias`` keys,
``completion_window``), with a fixed seed and a bounded number of examples."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_serving import start_stack

pytestmark = pytest.mark.timeout(300)
HOOKS = Path(__file__).with_name("fuzz_hooks.py")


def test_schemathesis_finds_no_server_error(tiny_model_dir, redis_url, tmp_path) -> None:
    stack = start_stack(tiny_model_dir, redis_url, prefill=1, decode=1, engine_kind="echo")
    try:
        st = Path(sys.executable).parent / "st"
        run = subprocess.run(
            [
                str(st),
                "run",
                stack.urls[0] + "/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "100",
                "--seed",
                "1",
                "--request-timeout",
                "30",
                "--generation-database",
                "none",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,  # its cache goes there, not here
            env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)},
        )
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-4000:]
        selected, total = map(int, re.search(r"Operations:\s+(\d+) selected / (\d+) total", out).groups())
        assert selected == total >= 8, out[-4000:]  # every operation, the two generation endpoints included
        generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", out).groups())
        assert generated == passed >= 300, out[-4000:]
        print(f"schemathesis: {selected} operations, {generated} test cases generated, all passed")
    finally:
        # fuzzed multi-choice requests can keep the decode busy up to its 30 s drain timeout
        assert stack.stop(grace_s=40) == []
