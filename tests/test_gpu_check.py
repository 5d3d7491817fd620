"""The device check (benchmarks/gpu_check.sh, gpu_bench.py, gpu_smoke.py) as its dry run runs it
here, on torch's CPU device: it brings back what it measured however it ends, in the order that
loses the least, and within its budget. The GPU machine is lent rarely and briefly: what can go wrong
in the scripts themselves must go wrong here."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_bench  # noqa: E402
from gpu_cells import Opts  # noqa: E402
from gpu_smoke import Smoke  # noqa: E402


def finished(doc: dict) -> list[str]:
    return [j["job"] for j in doc["jobs"] if j["status"] not in ("pending", "running")]


def test_the_jobs_run_in_the_order_that_loses_least_when_cut() -> None:
    """pdserve's speed first (after the seconds-long ceilings it is judged by), the eager reference last."""
    o = Opts.from_args(gpu_bench.parse_args([]))
    names = [j.name for j in gpu_bench.plan(o, list(gpu_bench.JOBS))]
    assert names == [
        "ceilings",
        "pdserve/llama3-8b",
        "pdserve/smollm2-135m",
        "handoff",
        "exact/smollm2-135m",
        "exact/llama3-8b-2l",
        "eager/llama3-8b",
        "eager/smollm2-135m",
    ]


def test_the_dry_run_rewrites_its_json_as_jobs_end_and_ends_within_its_budget(tmp_path: Path) -> None:
    """gpu_check.sh --device cpu, the smoke and bench steps: the JSON, read while the run goes on, is
    always whole, its finished jobs a prefix of the plan with their figures; at the end every job has
    run, within the budget the script gave it."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_STEPS": "smoke,bench"}
    proc = subprocess.Popen(
        ["bash", str(BENCHMARKS / "gpu_check.sh"), "--device", "cpu"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[dict] = []
    path = out / "gpu_bench.json"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if path.is_file():
            doc = json.loads(path.read_text())  # never half written
            if not seen or finished(doc) != finished(seen[-1]):
                seen.append(doc)
        time.sleep(0.1)
    output = proc.communicate(timeout=max(1, deadline - time.monotonic()))[0]
    assert proc.returncode == 0, output[-3000:]
    final = json.loads(path.read_text())
    plan = [j["job"] for j in final["jobs"]]
    assert plan[:2] == ["ceilings", "pdserve/tiny"] and plan[-1] == "eager/tiny"
    for doc in seen:
        assert finished(doc) == plan[: len(finished(doc))]
    middle = [d for d in seen if 0 < len(finished(d)) < len(plan)]
    assert len(middle) >= 3, [finished(d) for d in seen]  # rewritten as each job ended, not only at the end
    assert middle[0]["measured"]["copy_bandwidth_B_s"] > 0  # with the figures of what had finished
    assert final["complete"] and all(j["status"] == "ok" for j in final["jobs"])
    assert final["seconds"] <= final["budget_s"] and final["card"].startswith("cpu")
    decode = next(c for c in final["cells"] if c["job"] == "pdserve/tiny" and c["cell"] == "decode_b1")
    assert 0 < decode["of_bound"] < 1 and decode["bound_tok_s"] > decode["tok_s"]  # judged by this run's copy
    assert "smoke: ok" in output and "gpu_check: ok" in output
    assert {p.name for p in out.iterdir()} == {"check.log", "gpu_bench.json", "gpu_bench.log"}


def running(marker: str) -> list[int]:
    """The processes whose command line holds ``marker``."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue  # ended meanwhile
    return pids


def test_a_run_killed_mid_job_keeps_the_finished_jobs_figures(tmp_path: Path) -> None:
    """SIGKILL, as a device tool's hard limit sends it: no handler runs, and the JSON still holds the
    ceilings that had been measured, with the job that was running marked so; that job's process,
    in a session of its own, does not outlive the run."""
    path, models = tmp_path / "gpu_bench.json", tmp_path / "models"  # the job's command line names models
    cmd = [sys.executable, str(BENCHMARKS / "gpu_bench.py"), "--device", "cpu", "--only", "ceilings,pdserve"]
    proc = subprocess.Popen(
        [*cmd, "--out", str(path), "--models", str(models)], start_new_session=True, stdout=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            doc = json.loads(path.read_text()) if path.is_file() else {"jobs": []}
            if [j["status"] for j in doc["jobs"]] == ["ok", "running"]:  # the ceilings done, pdserve going
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    doc = json.loads(path.read_text())
    assert not doc["complete"] and doc["measured"]["copy_bandwidth_B_s"] > 0
    assert [(j["job"], j["status"]) for j in doc["jobs"]] == [("ceilings", "ok"), ("pdserve/tiny", "running")]
    deadline = time.monotonic() + 5  # SIGTERM at once; unstopped, the job would run ~10 s more
    while running(str(models)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(str(models)) == []


def test_the_check_refuses_limits_over_its_promise(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_BENCH_S": "400"}
    out = subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and "add up to 670 s, over GPU_CHECK_TOTAL_S (450 s)" in out.stderr
    assert not list(tmp_path.iterdir())  # refused before any step ran


def test_smoke_holds_carried_wheels_to_their_pins_and_their_requirements(tmp_path: Path) -> None:
    """pydantic and pydantic-core come apart (pydantic then raises at import): the smoke step names it."""
    pins = tmp_path / "requirements.txt"
    core = md.version("pydantic-core")
    pins.write_text(f"pydantic=={md.version('pydantic')}\npydantic-core=={core}\n")
    smoke = Smoke()
    assert smoke.carried(pins) == 2 and smoke.problems == []
    pins.write_text("pydantic-core==2.0.0\n")
    assert smoke.carried(pins) == 1
    assert smoke.problems == [f"pydantic-core: {core} is what imports, not the carried 2.0.0"]
