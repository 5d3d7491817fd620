"""Batch worker configuration: its own flags plus the router's (it routes lines like a router)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import socket

from pdserve.errors import ConfigError
from pdserve.flags import add_flags, from_args, setting
from pdserve.router.http.settings import RouterSettings

NO_LISTENER = 0
"""The port a batch worker's in-process router registers: it listens on none."""
ROUTER_FLAGS_NOT_USED = (
    "host",
    "port",
    "router_id",
    "access_log",
    "metrics",
    "api_key",
    "api_key_file",
    "quota_files",
    "quota_bytes",
    "quota_batches",
)
"""Router flags a batch worker has no use for: it listens on no port and answers no client (the
quotas refuse uploads and new batches; a batch's output files are counted, never refused)."""


@dataclasses.dataclass(frozen=True)
class BatchWorkerSettings:
    """One ``pdserve batch-worker`` process."""

    name: str = setting(
        "", "this worker's name in rq and its router id, unique (default batch-<hostname>-<pid>-<random>)"
    )
    concurrency: int = setting(
        8, "lines one worker sends at once while the instances serve no online request (default %(default)s)"
    )
    busy_concurrency: int = setting(
        2,
        "lines one worker sends at once while some instance of the model serves online requests "
        "(default %(default)s)",
    )
    max_load: float = setting(
        0.5,
        "spare capacity: a line is sent only while some instance of its model holds fewer sequences "
        "(running and queued) than this fraction of its --max-num-seqs; the instances run batch "
        "lines only in what online requests leave (default %(default)s)",
    )
    chunk_lines: int = setting(50, "lines per rq job (default %(default)s)")
    max_lines: int = setting(50000, "most lines one batch may hold (default %(default)s, as OpenAI)")
    metrics_port: int = setting(0, "serve Prometheus metrics on this port (default 0: off)")
    lease_ttl_ms: int = 5000
    """A running chunk renews its lease a few times per TTL; a chunk whose lease lapsed and whose rq
    job is not waiting in the queue is enqueued again after another TTL."""
    reaper_interval_s: float = 1.0
    router: RouterSettings = dataclasses.field(default_factory=RouterSettings)

    def __post_init__(self) -> None:
        if not self.name:
            host = socket.gethostname().split(".")[0][:64] or "host"
            # random too: a restarted worker (same host and pid, as in a container) must not meet
            # its predecessor's rq and router registrations, which outlive a SIGKILL for a while
            object.__setattr__(self, "name", f"batch-{host}-{os.getpid()}-{secrets.token_hex(3)}")
        for flag, value, low in (
            ("--concurrency", self.concurrency, 1),
            ("--busy-concurrency", self.busy_concurrency, 1),
            ("--chunk-lines", self.chunk_lines, 1),
            ("--max-lines", self.max_lines, 1),
            ("--metrics-port", self.metrics_port, 0),
        ):
            if value < low:
                raise ConfigError(f"{flag} must be at least {low} (got {value})")
        if not 0 < self.max_load <= 1:
            raise ConfigError(f"--max-load must be in (0, 1] (got {self.max_load})")
        if (self.router.router_id, self.router.port, self.router.background) != (
            self.name,
            NO_LISTENER,
            True,
        ):
            # registered as a router (instances drop the work of routers that are gone), port 0:
            # `pdserve status` tells it from the routers clients reach
            router = dataclasses.replace(self.router, router_id=self.name, port=NO_LISTENER, background=True)
            object.__setattr__(self, "router", router)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, cls)
        add_flags(parser, RouterSettings, exclude=ROUTER_FLAGS_NOT_USED)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchWorkerSettings:
        name = args.name or cls().name
        router = from_args(RouterSettings, args, router_id=name, metrics=False)
        return from_args(cls, args, name=name, router=router)
