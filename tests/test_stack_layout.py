"""`pdserve up`'s layout: picked for the host's usable cores when no layout flag is given (issue 45,
item 2), as given otherwise; each worker's threads from the usable cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.cli import build_parser
from pdserve.engine.cpu.host_cpu import usable_cores
from pdserve.errors import ConfigError
from pdserve.flags import from_args
from pdserve.stack_spec import StackSpec, worker_threads


def counts(spec: StackSpec) -> tuple[int | None, int | None, int | None]:
    return spec.prefill, spec.decode, spec.mixed


def parse_up(argv: list[str]) -> StackSpec:
    return from_args(StackSpec, build_parser().parse_args(["up", *argv]))


@pytest.mark.parametrize(
    ("cores", "device", "expected"),
    [
        (1, "cpu", (0, 0, 1)),
        (2, "cpu", (0, 0, 1)),
        (4, "cpu", (0, 0, 1)),
        (5, "cpu", (1, 1, 0)),
        (64, "cpu", (1, 1, 0)),
        (2, "cuda", (1, 1, 0)),  # a GPU: the pair sharing it, whatever the host's cores
    ],
)
def test_no_layout_flag_picks_by_usable_cores_and_device(cores, device, expected) -> None:
    spec = StackSpec()
    assert counts(spec) == (None, None, None) and not spec.layout_given
    picked = spec.with_layout(cores, device)
    assert counts(picked) == expected and picked.layout_given
    assert f"{cores} usable core" in picked.layout_reason or device == "cuda"
    assert picked.with_layout(1, "cpu") is picked  # picked once, then as given


def test_the_threshold_is_a_flag_and_autoscale_keeps_the_pair(monkeypatch) -> None:
    assert counts(StackSpec(mixed_below_cores=3).with_layout(3, "cpu")) == (1, 1, 0)
    assert counts(StackSpec(mixed_below_cores=8).with_layout(6, "cpu")) == (0, 0, 1)
    assert counts(StackSpec(autoscale=True).with_layout(2, "cpu")) == (1, 1, 0)  # the planner needs roles
    monkeypatch.setenv("PDSERVE_MIXED_BELOW_CORES", "2")
    assert counts(parse_up([]).with_layout(2, "cpu")) == (1, 1, 0)
    with pytest.raises(ConfigError, match="--mixed-below-cores"):
        StackSpec(mixed_below_cores=0)


def test_given_flags_win_and_the_others_keep_their_former_defaults(monkeypatch) -> None:
    """Any of --prefill/--decode/--mixed (flag or PDSERVE_*): the layout as given, the ones not given
    1 prefill, 1 decode, 0 mixed as before; nothing is picked."""
    for name in ("PREFILL", "DECODE", "MIXED"):
        monkeypatch.delenv(f"PDSERVE_{name}", raising=False)
    assert counts(parse_up([])) == (None, None, None)
    assert counts(parse_up(["--decode", "2"])) == (1, 2, 0)
    assert counts(parse_up(["--mixed", "1", "--prefill", "0", "--decode", "0"])) == (0, 0, 1)
    given = parse_up(["--prefill", "2", "--decode", "1"])
    assert given.with_layout(2, "cpu") is given and "as given" in given.layout_reason
    monkeypatch.setenv("PDSERVE_MIXED", "1")
    assert counts(parse_up([])) == (1, 1, 1)
    with pytest.raises(ConfigError, match="--prefill needs --decode"):
        StackSpec(prefill=1, decode=0)
    with pytest.raises(ConfigError, match="at least one of"):
        StackSpec(prefill=0, decode=0)


def test_max_workers_is_checked_before_the_layout_is_picked() -> None:
    assert StackSpec(autoscale=True, max_workers=2).max_workers == 2
    with pytest.raises(ConfigError, match="--max-workers needs --autoscale"):
        StackSpec(max_workers=2)


def test_up_help_says_how_it_picks_the_layout(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--mixed-below-cores" in text and "PDSERVE_MIXED_BELOW_CORES" in text
    assert "fewer usable cores" in text and "1 prefill + 1 decode" in text


def test_worker_threads_split_the_usable_cores() -> None:
    assert [worker_threads(c, 1) for c in (1, 2, 3, 4)] == [1, 2, 3, 4]
    assert [worker_threads(c, 2) for c in (1, 2, 4, 5, 8, 16)] == [1, 1, 2, 2, 4, 8]


def test_usable_cores_follow_the_affinity_mask() -> None:
    """taskset or a cpuset narrows what `up` and an engine count (os.cpu_count() would not): one
    allowed core, one thread for Paddle by default."""
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
    code += "from pdserve.engine.cpu.host_cpu import usable_cores; "
    code += (
        "from pdserve.engine.cpu.paddle_executor import set_threads; print(usable_cores(), set_threads(None))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split()[-2:] == ["1", "1"]
    assert usable_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("cores", "workers", "threads"),
    [(2, ["mixed-0"], 2), (4, ["mixed-0"], 4), (8, ["decode-0", "prefill-0"], 4)],
)
def test_up_starts_the_picked_layout_with_the_cores_split(
    cores, workers, threads, redis_url, tmp_path, monkeypatch, capsys
) -> None:
    """What `up` starts with no layout flag on a host of ``cores`` usable cores, a core's worth left
    to the routers and Redis (children stood in for by `sleep`: only their command lines are looked
    at), and what it prints."""
    from pdserve import stack as stack_module

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(stack_module, "usable_cores", lambda: cores)
    monkeypatch.setattr(
        stack_module.Stack,
        "_spawn",
        lambda self, name: subprocess.Popen(["sleep", "60"], start_new_session=True),
    )
    stack = stack_module.Stack(
        StackSpec(model="tiny", redis_url=redis_url, engine_kind="echo", batch_workers=0)
    )
    try:
        stack.start()
    finally:
        stack.stop(grace_s=5)
    assert [name for name, _ in stack.workers] == workers
    for name in workers:
        argv = stack.argv[name]
        assert argv[argv.index("--threads") + 1] == str(threads), argv
    out = capsys.readouterr().out
    assert f"{cores} usable core" in out and f"layout: {stack.spec.prefill} prefill" in out


def test_workers_get_passive_openmp_when_told(redis_url, tmp_path, monkeypatch) -> None:
    """--omp-passive (default off): each worker's environment has OMP_WAIT_POLICY=PASSIVE and
    KMP_BLOCKTIME=0, the router's not; a variable set in up's environment wins; without it, neither."""
    from pdserve import stack as stack_module

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    for name in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(
        stack_module.Stack,
        "_spawn",
        lambda self, name: subprocess.Popen(["sleep", "60"], start_new_session=True),
    )

    def started(**options) -> stack_module.Stack:
        spec = StackSpec(model="tiny", redis_url=redis_url, engine_kind="echo", batch_workers=0, **options)
        stack = stack_module.Stack(spec)
        try:
            stack.start()
        finally:
            stack.stop(grace_s=5)
        return stack

    stack = started(mixed=1, prefill=0, decode=0, omp_passive=True)
    assert stack.child_env("mixed-0")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert stack.child_env("mixed-0")["KMP_BLOCKTIME"] == "0"
    assert "KMP_BLOCKTIME" not in stack.child_env("router-0")
    assert "OMP_WAIT_POLICY" not in started(mixed=1).child_env("mixed-0")
    monkeypatch.setenv("KMP_BLOCKTIME", "50")
    env = stack.child_env("mixed-0")
    assert env["KMP_BLOCKTIME"] == "50" and "OMP_WAIT_POLICY" not in env
