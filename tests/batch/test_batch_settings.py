"""`pdserve batch-worker`'s settings: its in-process router is background, portless and named
after the worker; bad values name their flag."""

from __future__ import annotations

import pytest

from pdserve.batch.settings import BatchWorkerSettings
from pdserve.cli import build_parser
from pdserve.errors import ConfigError


def parse(*argv: str) -> BatchWorkerSettings:
    return BatchWorkerSettings.from_args(build_parser().parse_args(["batch-worker", *argv]))


def test_the_in_process_router_is_background_portless_and_named_after_the_worker() -> None:
    s = parse("--concurrency", "3", "--retry-attempts", "5")
    assert (s.concurrency, s.router.retry_attempts) == (3, 5)
    assert s.router.background and s.router.port == 0 and s.router.router_id == s.name
    assert s.name.startswith("batch-") and parse().name != s.name  # a fresh name per start
    assert parse("--name", "b1").router.router_id == "b1"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--max-load", "0"], "--max-load"),
        (["--max-load", "1.5"], "--max-load"),
        (["--chunk-lines", "0"], "--chunk-lines"),
        (["--name", "a:b"], "router id"),
    ],
)
def test_bad_values_name_their_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        parse(*argv)


def test_a_router_refuses_port_0_which_only_batch_workers_use() -> None:
    from pdserve.router.http.server import run_router

    with pytest.raises(ConfigError, match="--port"):
        run_router(build_parser().parse_args(["router", "--port", "0"]))
